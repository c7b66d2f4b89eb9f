"""Proposals: the token tree a drafter hands to the target each cycle, and EAGLE-2's dynamic draft tree.

A :class:`Tree` is the one proposal type (a chain is a tree whose every node has one child); node 0 is the root. What
the root is, the numbering, padding and static sizes, and why EAGLE-2's best N nodes include their ancestors:
docs/design.md#proposals and docs/design.md#the-decode-cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .draft import DraftModel, DraftOutput
from .kv_cache import DraftCache
from .vocab import DraftVocab


@dataclass
class Tree:
    tokens: torch.Tensor  # [N+1] target token ids, root first
    parents: torch.Tensor  # [N+1] parent node of each node (the root and padding nodes: 0)
    depths: torch.Tensor  # [N+1] 0 for the root
    ancestors: torch.Tensor  # [N+1, N+1] bool, ancestors[i, j]: j is i or an ancestor of i
    draft_order: torch.Tensor  # [N+1] nodes by descending draft score (root first, padding last)
    max_depth: int  # static bound on ``depths`` (the drafter's depth)
    valid: torch.Tensor | None = None  # [N+1] bool, False for padding nodes; None: every node is real
    q: torch.Tensor | None = None  # [N+1, V] draft distribution each node's children were sampled from (p/q rules)
    grafted: int = 0  # the last nodes are a prompt-lookup chain's (:func:`graft`), this many

    def ranks(self) -> torch.Tensor:
        """[N+1] each node's position in ``draft_order`` (the root is 0)."""
        rank = torch.empty_like(self.draft_order)
        rank[self.draft_order] = torch.arange(self.size, device=rank.device)
        return rank

    @property
    def size(self) -> int:
        return self.tokens.shape[-1]

    def compact(self) -> Tree:
        """The tree without its padding nodes (the same tree where there are none). Reads ``valid`` on the host: a
        sync on a GPU, where static shapes are kept instead."""
        if self.valid is None or bool(self.valid.all()):
            return self
        kept = self.valid.nonzero().flatten()  # [M+1], the root first: a padding node is never an ancestor
        index = self.valid.long().cumsum(0) - 1  # [N+1] each kept node's new number
        order = self.draft_order[self.valid[self.draft_order]]
        chain = int(self.valid[self.size - self.grafted :].sum()) if self.grafted else 0
        return Tree(self.tokens[kept], index[self.parents[kept]], self.depths[kept],
                    self.ancestors[kept][:, kept], index[order], self.max_depth, None,
                    None if self.q is None else self.q[kept], chain)


def build_tree(root: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor,
               levels: torch.Tensor, total_tokens: int, max_depth: int | None = None) -> Tree:
    """Keep the ``total_tokens`` best candidates and index them as a tree of exactly ``total_tokens + 1`` nodes.

    root [1] target id; tokens / scores / parents / levels [M] over all drafted candidates (parents are candidate
    indices, -1 for children of the root; candidates are ordered by level). With M < ``total_tokens`` the tree is
    padded. ``max_depth``: the deepest level (default: read from ``levels``, which costs a host sync).
    """
    device = scores.device
    if max_depth is None:
        max_depth = int(levels.max())
    m = scores.shape[0]
    if m < total_tokens:  # pad with candidates that score -inf, hang from the root and are never valid
        pad = total_tokens - m
        tokens = torch.cat((tokens, tokens.new_zeros(pad)))
        scores = torch.cat((scores, scores.new_full((pad,), float("-inf"))))
        parents = torch.cat((parents, parents.new_full((pad,), -1)))
        levels = torch.cat((levels, levels.new_ones(pad)))
    real = torch.arange(tokens.shape[0], device=device) < m
    order = torch.sort(scores, descending=True, stable=True).indices[:total_tokens]
    keep = order.sort().values  # ascending candidate index: parents before children
    n = keep.shape[0]
    local = torch.zeros(tokens.shape[0] + 1, dtype=torch.long, device=device)
    local[keep] = torch.arange(1, n + 1, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    node_parents = torch.cat((zero, local[parents[keep]]))
    # parents[keep] is -1 for level-1 nodes, which indexes the extra last slot of `local` (0 = the root)
    depths = torch.cat((zero, levels[keep]))
    valid = torch.cat((torch.ones(1, dtype=torch.bool, device=device), real[keep]))
    ancestors = torch.eye(n + 1, dtype=torch.bool, device=device)
    for _ in range(max_depth):
        ancestors = ancestors | ancestors[node_parents]
    rank = torch.sort(scores[keep], descending=True, stable=True).indices + 1
    draft_order = torch.cat((zero, rank))
    return Tree(torch.cat((root, tokens[keep])), node_parents, depths, ancestors, draft_order, max_depth,
                valid if m < total_tokens else None)


def chain(root: torch.Tensor, tokens: torch.Tensor, size: int | None = None, q: torch.Tensor | None = None) -> Tree:
    """A chain proposal: root [1], then ``tokens`` [n] each the child of the previous one, padded to ``size`` drafted
    nodes (default n). ``q`` [n+1, V] (optional): row i is the draft distribution token i+1 was sampled from."""
    device = root.device
    n = tokens.shape[0]
    size = n if size is None else size
    if size < n:
        raise ValueError(f"a chain of {n} tokens does not fit in {size} nodes")
    idx = torch.arange(size + 1, device=device)
    real = idx <= n
    pad = size - n
    all_tokens = torch.cat((root, tokens, tokens.new_zeros(pad)))
    parents = torch.where(real, (idx - 1).clamp(min=0), 0)
    depths = torch.where(real, idx, 1)
    ancestors = (idx[None, :] <= idx[:, None]) & real[:, None] & real[None, :]
    ancestors |= torch.eye(size + 1, dtype=torch.bool, device=device)
    if q is not None and pad:
        q = torch.cat((q, q.new_zeros(pad, q.shape[1])))
    return Tree(all_tokens, parents, depths, ancestors, idx, size, real if pad else None, q)


@torch.inference_mode()
def draft_tree(draft: DraftModel, vocab: DraftVocab, cache: DraftCache, root: torch.Tensor, last: DraftOutput,
               depth: int, top_k: int, total_tokens: int) -> Tree:
    """Grow a tree below ``root`` from the head's output at the last context position (``last``: [1, 1, H]).

    The draft cache holds the context (positions 0..ctx-1); expanded nodes are appended to it and cropped at the end.
    Nothing here waits for the device.
    """
    ctx = cache.length
    device = root.device
    logp = F.log_softmax(vocab.logits(last.predict[0, -1]).float(), dim=-1)  # [V_d]
    scores, ids = logp.topk(top_k)  # [k]
    all_ids, all_scores = [ids], [scores]
    all_parents = [torch.full((top_k,), -1, dtype=torch.long, device=device)]
    all_levels = [torch.ones(top_k, dtype=torch.long, device=device)]
    frontier = torch.arange(top_k, device=device)  # candidate index of each frontier node
    features = last.regress[:, -1:].expand(1, top_k, -1)  # [1, k, H]
    ancestry = torch.eye(top_k, dtype=torch.bool, device=device)  # [k, k*(level)] over appended frontier entries
    context = torch.ones(top_k, ctx, dtype=torch.bool, device=device)
    offset = top_k
    for level in range(1, depth):
        position = torch.full((1, top_k), ctx + level - 1, dtype=torch.long, device=device)
        mask = torch.cat((context, ancestry), dim=1)[None, None]
        out = draft(vocab.to_target_ids(ids)[None], features, position, mask, cache=cache)
        child_logp = F.log_softmax(vocab.logits(out.predict[0]).float(), dim=-1)  # [k, V_d]
        child_scores, child_ids = child_logp.topk(top_k, dim=-1)  # [k, k]
        flat = (scores[:, None] + child_scores).flatten()  # [k*k]
        all_ids.append(child_ids.flatten())
        all_scores.append(flat)
        all_parents.append(frontier[:, None].expand(top_k, top_k).flatten())
        all_levels.append(torch.full((top_k * top_k,), level + 1, dtype=torch.long, device=device))
        if level == depth - 1:
            break
        scores, best = flat.topk(top_k)
        rows = best // top_k  # frontier row each new frontier node hangs from
        ids = child_ids.flatten()[best]
        frontier = offset + best
        features = out.regress[:, rows]
        ancestry = torch.cat((ancestry[rows], torch.eye(top_k, dtype=torch.bool, device=device)), dim=1)
        offset += top_k * top_k
    cache.length = ctx
    tokens = vocab.to_target_ids(torch.cat(all_ids))
    return build_tree(root, tokens, torch.cat(all_scores), torch.cat(all_parents), torch.cat(all_levels),
                      total_tokens, max_depth=depth)


def graft(tree: Tree, tokens: torch.Tensor, valid: torch.Tensor) -> Tree:
    """``tree`` with a chain of K tokens [K] added below its deepest node whose path from the root spells the chain's
    first tokens, so that no two siblings carry the same token. ``valid`` [K] bool marks the chain's real tokens (a
    prefix: a chain that runs out is padded); chain tokens already in the tree, and padding, become padding nodes.
    Static shapes (``tree.size + K`` nodes, depth ``max(tree.max_depth, K)``), no host sync. A batch of trees (fields
    with a leading row axis, :mod:`griffin.batch`) takes chains [B, K], each row's onto its own tree."""
    if tree.q is not None:
        raise ValueError("a chain can only be grafted onto a tree of deterministic drafts (tree.q is set)")
    device = tokens.device
    n1, k = tree.size, tokens.shape[-1]
    lead = tokens.shape[:-1]  # () for one tree, (B,) for a batch
    real = tree.valid if tree.valid is not None else torch.ones_like(tree.tokens, dtype=torch.bool)
    level = (tree.depths - 1).clamp(0, k - 1)  # the chain token each node would have to equal
    spells = (tree.tokens == tokens.gather(-1, level)) & valid.gather(-1, level) & (tree.depths <= k) & real
    spells[..., 0] = True
    on_chain = ~(tree.ancestors & ~spells[..., None, :]).any(dim=-1)  # [.., N+1] the node and its ancestors spell it
    stem = torch.where(on_chain, tree.depths, -1).argmax(dim=-1, keepdim=True)  # [.., 1] the deepest such node
    first = tree.depths.gather(-1, stem)  # [.., 1] chain tokens before this one are in the tree already
    j = torch.arange(k, device=device)
    new = valid & (j >= first)  # [.., K] chain nodes that join the tree
    parents = torch.where(new, torch.where(j == first, stem, n1 + j - 1), 0)
    depths = torch.where(new, j + 1, 1)
    stem_line = tree.ancestors.gather(-2, stem[..., None].expand(*lead, 1, n1))  # [.., 1, N+1] the stem's ancestors
    ancestors = torch.zeros(*lead, n1 + k, n1 + k, dtype=torch.bool, device=device)
    ancestors[..., :n1, :n1] = tree.ancestors
    ancestors[..., n1:, :n1] = stem_line & new[..., :, None]
    ancestors[..., n1:, n1:] = (j[None, :] <= j[:, None]) & (j[None, :] >= first[..., None]) & new[..., :, None]
    ancestors[..., n1:, 0] = True
    ancestors[..., n1 + j, n1 + j] = True
    return Tree(torch.cat((tree.tokens, tokens), dim=-1), torch.cat((tree.parents, parents), dim=-1),
                torch.cat((tree.depths, depths), dim=-1), ancestors,
                torch.cat((tree.draft_order, (n1 + j).expand(*lead, k)), dim=-1),
                max(tree.max_depth, k), torch.cat((real, new), dim=-1), grafted=k)
