"""EAGLE-2's dynamic draft tree: expand the ``top_k`` best nodes per level, then keep the ``total_tokens`` best overall.

Node 0 is the root (the last token not yet seen by the target); nodes 1..N are drafted tokens, numbered so that a
parent always precedes its children. Scores are cumulative draft log-probabilities, which never rise along a path, so
the best N nodes (ties broken towards shallower nodes) include every ancestor of each node they include.
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
    parents: torch.Tensor  # [N+1] parent node of each node (the root is its own parent)
    depths: torch.Tensor  # [N+1] 0 for the root
    ancestors: torch.Tensor  # [N+1, N+1] bool, ancestors[i, j]: j is i or an ancestor of i
    draft_order: torch.Tensor  # [N+1] nodes by descending draft score (root first)

    def ranks(self) -> torch.Tensor:
        """[N+1] each node's position in ``draft_order`` (the root is 0)."""
        rank = torch.empty_like(self.draft_order)
        rank[self.draft_order] = torch.arange(self.size, device=rank.device)
        return rank

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def build_tree(root: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor,
               levels: torch.Tensor, total_tokens: int) -> Tree:
    """Keep the ``total_tokens`` best candidates and index them as a tree.

    root [1] target id; tokens / scores / parents / levels [M] over all drafted candidates (parents are candidate
    indices, -1 for children of the root; candidates are ordered by level).
    """
    order = torch.sort(scores, descending=True, stable=True).indices[:total_tokens]
    keep = order.sort().values  # ascending candidate index: parents before children
    n = keep.shape[0]
    local = torch.full((scores.shape[0] + 1,), 0, dtype=torch.long, device=scores.device)
    local[keep] = torch.arange(1, n + 1, device=scores.device)
    node_parents = torch.cat((torch.zeros(1, dtype=torch.long, device=keep.device), local[parents[keep]]))
    # parents[keep] is -1 for level-1 nodes, which indexes the extra last slot of `local` (0 = the root)
    depths = torch.cat((torch.zeros(1, dtype=torch.long, device=keep.device), levels[keep]))
    ancestors = torch.eye(n + 1, dtype=torch.bool, device=keep.device)
    for _ in range(int(levels.max())):
        ancestors = ancestors | ancestors[node_parents]
    rank = torch.sort(scores[keep], descending=True, stable=True).indices + 1
    draft_order = torch.cat((torch.zeros(1, dtype=torch.long, device=keep.device), rank))
    return Tree(torch.cat((root, tokens[keep])), node_parents, depths, ancestors, draft_order)


@torch.inference_mode()
def draft_tree(draft: DraftModel, vocab: DraftVocab, cache: DraftCache, root: torch.Tensor, last: DraftOutput,
               depth: int, top_k: int, total_tokens: int) -> Tree:
    """Grow a tree below ``root`` from the head's output at the last context position (``last``: [1, 1, H]).

    The draft cache holds the context (positions 0..ctx-1); expanded nodes are appended to it and cropped at the end.
    """
    ctx = cache.length
    device = root.device
    logp = F.log_softmax(vocab.logits(last.predict[0, -1]).float(), dim=-1)  # [V]
    scores, ids = logp.topk(top_k)  # [k]
    all_ids, all_scores = [ids], [scores]
    all_parents = [torch.full((top_k,), -1, dtype=torch.long, device=device)]
    all_levels = [torch.ones(top_k, dtype=torch.long, device=device)]
    frontier = torch.arange(top_k, device=device)  # candidate index of each frontier node
    features = last.regress[:, -1:].expand(1, top_k, -1)  # [1, k, H]
    ancestry = torch.eye(top_k, dtype=torch.bool, device=device)  # [k, k*(level)] over appended frontier entries
    offset = top_k
    for level in range(1, depth):
        position = torch.full((1, top_k), ctx + level - 1, dtype=torch.long, device=device)
        mask = torch.cat((torch.ones(top_k, ctx, dtype=torch.bool, device=device), ancestry), dim=1)[None, None]
        out = draft(vocab.to_target_ids(ids)[None], features, position, mask, cache=cache)
        child_logp = F.log_softmax(vocab.logits(out.predict[0]).float(), dim=-1)  # [k, V]
        child_scores, child_ids = child_logp.topk(top_k, dim=-1)  # [k, k]
        flat = (scores[:, None] + child_scores).flatten()  # [k*k]
        all_ids.append(child_ids.flatten())
        all_scores.append(flat)
        all_parents.append(frontier.repeat_interleave(top_k))
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
                      total_tokens)
