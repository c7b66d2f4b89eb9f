"""Batched speculative generation: B prompts of different lengths decoded together, every row exactly its own output.

One static tree shape per cycle for the whole batch (the generator's tree, or the one tuned for the batch size,
:func:`griffin.autotune.autotune_batch`), so that a cycle keeps one host sync whatever B is:

1. the head drafts B trees at once (:class:`BatchHeadDrafter`: one batched head pass per level, each row over its own
   draft context);
2. one target pass verifies all B x (N+1) nodes, each row over its own entries of a :class:`griffin.kv_cache.RowsCache`
   (rows have different lengths: the new entries go to the same slots of every row, the attention mask hides each
   shorter row's gap, positions are each row's own);
3. each row's accepted path is chosen on the device (:func:`follow_rows`, the rules of :mod:`griffin.verify`), its
   entries moved right after the row's own (:meth:`RowsCache.compact`);
4. one ``.tolist()`` brings every row's emitted tokens, counts and stop flags; rows that finished (EOS, budget) are
   dropped from the caches and the drafter, so they stop costing compute.

A batch of one never comes here (the generator runs :func:`griffin.decode.decode`). With no drafter the loop is the
batched plain loop (:func:`griffin.plain.plain_rows_step`). Each prompt is prefilled alone, as a one-prompt generation
prefills it. With ``lookup``, each row's tree carries its own prompt-lookup chain (:class:`BatchPromptLookup`).
Adaptation is per batch: one :class:`griffin.adapt.ShapePolicy` over shapes priced at the batch size picks each
cycle's shape (or a plain step of every row) from what each row accepted. Not batched: draft LMs.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .adapt import PLAIN, ShapePolicy
from .backend import TargetBackend
from .decode import GenerationStats
from .draft import DraftModel, DraftOutput
from .drafters import MAX_CONTEXT_VOCAB, Context, chained_shape, lookup_ngrams, tree_nodes
from .kv_cache import BufferCache, DraftCache, RowsCache, move_entries
from .plain import plain_rows_step
from .sampling import SamplingConfig, greedy, sample, warp
from .tree import Tree, graft
from .vocab import DraftVocab

EARN_FROM = 2  # chain tokens a row offers before the target has accepted any (BatchPromptLookup with trim)


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, T, ..] at index [B, m] along T -> [B, m, ..]."""
    return x.gather(1, index.view(*index.shape, *[1] * (x.dim() - 2)).expand(*index.shape, *x.shape[2:]))


def build_trees(root: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor,
                levels: torch.Tensor, total_tokens: int, max_depth: int) -> Tree:
    """:func:`griffin.tree.build_tree` for B rows: root [B]; tokens / scores / parents [B, M] and levels [M] over the
    drafted candidates (M >= ``total_tokens``) -> a :class:`Tree` whose fields have a leading row axis."""
    b, m = scores.shape
    device = scores.device
    keep = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :total_tokens].sort(dim=1).values
    n = keep.shape[1]
    local = torch.zeros(b, m + 1, dtype=torch.long, device=device)  # candidate -> node (the last slot: the root)
    local.scatter_(1, keep, torch.arange(1, n + 1, device=device).expand(b, n))
    kept_parents = parents.gather(1, keep)
    zero = torch.zeros(b, 1, dtype=torch.long, device=device)
    node_parents = torch.cat((zero, local.gather(1, torch.where(kept_parents < 0, m, kept_parents))), dim=1)
    depths = torch.cat((zero, levels[keep]), dim=1)
    ancestors = torch.eye(n + 1, dtype=torch.bool, device=device).repeat(b, 1, 1)  # [B, N+1, N+1]
    for _ in range(max_depth):
        ancestors = ancestors | _gather_rows(ancestors, node_parents)
    rank = torch.sort(scores.gather(1, keep), dim=1, descending=True, stable=True).indices + 1
    return Tree(torch.cat((root[:, None], tokens.gather(1, keep)), dim=1), node_parents, depths, ancestors,
                torch.cat((zero, rank), dim=1), max_depth)


def follow_rows(tree: Tree, choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`griffin.verify.follow` for B rows: trees with a leading row axis, ``choice`` [B, N+1] the token the
    target emits after each node -> (path [B, D+1], accepted length [B], bonus [B])."""
    b, n1 = tree.tokens.shape
    device = choice.device
    nodes = torch.arange(n1, device=device)
    match = (tree.parents[:, None, :] == nodes[None, :, None]) & (tree.tokens[:, None, :] == choice[:, :, None])
    match[:, :, 0] = False  # [B, node, child]; the root is nobody's child
    if tree.valid is not None:  # padding nodes are never entered
        match &= tree.valid[:, None, :]
    rank = torch.empty_like(tree.draft_order).scatter_(1, tree.draft_order, nodes.expand(b, n1))
    first = torch.where(match, rank[:, None, :], n1).argmin(dim=2)  # [B, N+1] chosen child of each node
    moved = match.any(dim=2)
    chosen = moved.gather(1, tree.parents) & (first.gather(1, tree.parents) == nodes)
    chosen[:, 0] = True
    reached = ~(tree.ancestors & ~chosen[:, None, :]).any(dim=2)
    deepest = torch.where(reached, tree.depths, -1).argmax(dim=1)  # [B]
    length = tree.depths.gather(1, deepest[:, None])[:, 0]
    on_path = _gather_rows(tree.ancestors, deepest[:, None])[:, 0]  # [B, N+1]
    levels = torch.arange(tree.max_depth + 1, device=device)
    at_level = on_path[:, None, :] & (tree.depths[:, None, :] == levels[None, :, None])  # [B, D+1, N+1]
    return at_level.int().argmax(dim=2), length, choice.gather(1, deepest[:, None])[:, 0]


class BatchHeadDrafter:
    """EAGLE-2 dynamic trees of one shape for B rows at once, with a head's batched passes and a draft cache of B
    rows (row b's entries: slots ``0..lengths[b]-1``, gaps masked as in :class:`RowsCache`). One draft vocabulary
    serves the batch (the context tokens of every row join it)."""

    def __init__(self, draft: DraftModel, depth: int, top_k: int, total_tokens: int, rows: int, capacity: int):
        self.draft, self.depth, self.top_k, self.max_depth = draft, depth, top_k, depth
        self.total_tokens = tree_nodes(depth, top_k, total_tokens)
        self.vocab = DraftVocab(draft)
        self.vocab.reserve(-(-min(rows * capacity, MAX_CONTEXT_VOCAB) // 256) * 256)
        cfg, weight = draft.config, draft.fusion.fc.weight
        self.cache = DraftCache(cfg.num_key_value_heads, cfg.head_dim, capacity + depth * top_k, weight.dtype,
                                weight.device, rows)
        self.lengths: list[int] = []  # each row's draft entries, on the host (the cache's slots to keep)
        self.offsets: torch.Tensor | None = None  # [B] the same on the device, moved there by device counts
        self.last: DraftOutput | None = None  # the head's output at each row's last position, [B, 1, ..]
        self.unread: list[tuple[torch.Tensor, torch.Tensor]] = []  # plain steps' tokens [B, 1], features [B, 1, H]
        self.prompts: tuple | None = None  # start's arguments until the first tree reads them

    def start(self, prompts: list[torch.Tensor], hidden: list[torch.Tensor], tokens: torch.Tensor) -> None:
        """Row b reads its prompt [P_b] with the target's features [P_b, H] and its first new token ``tokens[b]``,
        at the first tree (a batch that adapts may never draft one)."""
        self.prompts, self.unread = (prompts, hidden, tokens), []

    @torch.inference_mode()
    def _read_prompts(self, prompts: list[torch.Tensor], hidden: list[torch.Tensor], tokens: torch.Tensor) -> None:
        device = tokens.device
        longest = max(p.shape[0] for p in prompts)
        inputs = torch.stack([F.pad(torch.cat((p[1:], t[None])), (0, longest - p.shape[0]))
                              for p, t in zip(prompts, tokens, strict=True)])  # [B, P]
        features = torch.stack([F.pad(h, (0, 0, 0, longest - h.shape[0])) for h in hidden])  # [B, P, H]
        self.vocab.add(inputs.flatten())
        self.lengths = [p.shape[0] for p in prompts]
        self.cache.length = 0
        cache = self.cache  # rows that finished at their first token never reach the drafter
        cache.keys, cache.values = cache.keys[: len(prompts)], cache.values[: len(prompts)]
        slots = torch.arange(longest, device=device)
        lengths = self.offsets = torch.tensor(self.lengths, device=device)
        mask = (slots[None, None, :] <= slots[None, :, None]) & ((slots < lengths[:, None])[:, None, :]
                                                                 | (slots[None, None, :] == slots[None, :, None]))
        out = self.draft(inputs, features, slots.expand(len(prompts), -1), mask[:, None], cache=self.cache)
        self.last = self._at(out, lengths - 1)

    def resize(self, depth: int, total_tokens: int) -> None:
        """The next cycles' tree shape (adaptation), at most as deep as the one the draft cache was made for."""
        if depth > self.max_depth:
            raise ValueError(f"a tree of depth {depth} does not fit a drafter made for depth {self.max_depth}")
        self.depth, self.total_tokens = depth, tree_nodes(depth, self.top_k, total_tokens)

    @staticmethod
    def _at(out: DraftOutput, index: torch.Tensor) -> DraftOutput:
        return out._replace(predict=_gather_rows(out.predict, index[:, None]),
                            regress=_gather_rows(out.regress, index[:, None]))

    def _context(self, queries: int) -> torch.Tensor:
        """[B, queries, end] bool: each row's own draft entries."""
        visible = torch.arange(self.cache.length, device=self.offsets.device)[None, :] < self.offsets[:, None]
        return visible[:, None, :].expand(-1, queries, -1)

    def read(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        """A plain step of every row emitted ``tokens`` [B, 1] from ``features`` [B, 1, H]: kept until the next tree,
        which reads every plain step since the last one in one head pass."""
        self.unread.append((tokens, features))

    def promising(self) -> bool:
        """Whether a probe may pay now: a head has no evidence short of drafting, so always."""
        return True

    @torch.inference_mode()
    def propose(self, roots: torch.Tensor) -> Tree:
        """B trees below ``roots`` [B] (each row's newest token), with tensor operations only."""
        if self.prompts is not None:
            self._read_prompts(*self.prompts)
            self.prompts = None
        if self.unread:
            n, b = len(self.unread), roots.shape[0]
            tokens, features = (torch.cat(parts, dim=1) for parts in zip(*self.unread, strict=True))
            self.unread = []
            self.accept(tokens, features, [n] * b, torch.full((b,), n, device=roots.device))
        k, b, device = self.top_k, roots.shape[0], roots.device
        vocab, end = self.vocab, self.cache.length
        logp = F.log_softmax(vocab.logits(self.last.predict[:, -1]).float(), dim=-1)  # [B, V_d]
        scores, ids = logp.topk(k)  # [B, k]
        all_ids, all_scores = [ids], [scores]
        all_parents = [torch.full((b, k), -1, dtype=torch.long, device=device)]
        all_levels = [torch.ones(k, dtype=torch.long, device=device)]
        frontier = torch.arange(k, device=device).expand(b, k)
        features = self.last.regress[:, -1:].expand(b, k, -1)  # [B, k, H]
        eye = torch.eye(k, dtype=torch.bool, device=device).expand(b, k, k)
        ancestry = eye  # [B, k, k*level] over the appended frontier entries
        context = self._context(k)
        base = self.offsets[:, None]  # each row's next draft position
        offset = k
        for level in range(1, self.depth):
            mask = torch.cat((context, ancestry), dim=2)[:, None]
            out = self.draft(vocab.to_target_ids(ids), features, (base + level - 1).expand(b, k), mask,
                             cache=self.cache)
            child_logp = F.log_softmax(vocab.logits(out.predict).float(), dim=-1)  # [B, k, V_d]
            child_scores, child_ids = child_logp.topk(k, dim=-1)  # [B, k, k]
            flat = (scores[:, :, None] + child_scores).flatten(1)  # [B, k*k]
            all_ids.append(child_ids.flatten(1))
            all_scores.append(flat)
            all_parents.append(frontier[:, :, None].expand(b, k, k).flatten(1))
            all_levels.append(torch.full((k * k,), level + 1, dtype=torch.long, device=device))
            if level == self.depth - 1:
                break
            scores, best = flat.topk(k)  # [B, k]
            rows = best // k  # the frontier node each new one hangs from
            ids = child_ids.flatten(1).gather(1, best)
            frontier = offset + best
            features = _gather_rows(out.regress, rows)
            ancestry = torch.cat((_gather_rows(ancestry, rows), eye), dim=2)
            offset += k * k
        self.cache.length = end
        return build_trees(roots, vocab.to_target_ids(torch.cat(all_ids, dim=1)), torch.cat(all_scores, dim=1),
                           torch.cat(all_parents, dim=1), torch.cat(all_levels), self.total_tokens, self.depth)

    @torch.inference_mode()
    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor, counts: list[int], device_counts: torch.Tensor
               ) -> None:
        """Row b emitted ``tokens[b, :counts[b]]`` ([B, C], padded) from the positions whose target features are
        ``hidden[b, :counts[b]]`` ([B, C, H]); ``device_counts`` [B]: the counts still on the device."""
        b, c = tokens.shape
        device = tokens.device
        self.vocab.add(tokens.flatten())
        end = self.cache.length
        lengths = self.offsets
        steps = torch.arange(c, device=device)
        causal = (steps[None, :] <= steps[:, None]).expand(b, c, c)
        mask = torch.cat((self._context(c), causal), dim=2)[:, None]
        out = self.draft(tokens, hidden, lengths[:, None] + steps, mask, cache=self.cache)
        for buf in (self.cache.keys, self.cache.values):
            move_entries(buf, (end + steps).expand(b, c), lengths[:, None] + steps)
        self.last = self._at(out, device_counts - 1)
        self.lengths = [n + k for n, k in zip(self.lengths, counts, strict=True)]
        self.offsets = lengths + device_counts
        self.cache.length = max(self.lengths)

    def select(self, rows: list[int]) -> None:
        """Keep only ``rows``."""
        keep = torch.tensor(rows, device=self.cache.keys.device)
        self.unread = [(t[keep], f[keep]) for t, f in self.unread]
        if self.prompts is not None:  # no tree yet: only the prompts to read are kept
            prompts, hidden, tokens = self.prompts
            self.prompts = [prompts[r] for r in rows], [hidden[r] for r in rows], tokens[keep]
            return
        self.cache.keys, self.cache.values = self.cache.keys[keep], self.cache.values[keep]
        self.last = self.last._replace(predict=self.last.predict[keep], regress=self.last.regress[keep])
        self.lengths = [self.lengths[r] for r in rows]
        self.offsets = self.offsets[keep]
        self.cache.length = max(self.lengths)


class BatchPromptLookup:
    """:class:`griffin.drafters.PromptLookup` for B rows: each row's chain is copied from its own context and grafted
    onto its own tree (:func:`griffin.tree.graft`). The rows' trees keep one shape: a chain of ``tokens`` nodes in
    every row (static shapes), or with ``trim`` (the CPU, where reading a tensor costs no sync) of the most real
    tokens any row offers, padding where a row offers fewer, and no chain in a cycle where no row found a match.

    With ``trim`` each row also earns its chain's length (``earn=None``: it offers all it found): it offers at most
    ``limits[b]`` tokens, ``earn`` at first, doubled (up to ``tokens``) when the target accepted all it offered and
    cut to what it accepted (at least 1) otherwise. One row's matched chain widens every row's pass: on first turns,
    where little text repeats, a full chain at batch 2 cost more than it gave, while on second turns, which copy from
    the first answer, it paid; the earned chain keeps most of both
    (``benchmarks/results/amd-epyc-zen4/chain-earned.md``), since a row that is copying reaches the full chain in a
    few cycles."""

    def __init__(self, inner: BatchHeadDrafter, tokens: int, capacity: int, ngrams: tuple[int, ...] | None = None,
                 trim: bool = False, earn: int | None = EARN_FROM):
        if earn is not None and earn < 1:
            raise ValueError(f"earn={earn}: a row must offer at least 1 chain token at first (None: all it found)")
        self.inner, self.tokens, self.ngrams, self.trim = inner, tokens, lookup_ngrams(tokens, ngrams, trim), trim
        self.capacity, self.earning, self.earn = capacity, trim and earn is not None, earn
        self.depth, self.total_tokens = chained_shape(inner, tokens)
        self.contexts: list[Context] = []
        self.limits: list[int] = []  # earning: the most chain tokens each row offers next
        self.offered: list[list[int]] = []  # earning: each row's chain tokens in the last tree (none: no chain)

    def resize(self, depth: int, total_tokens: int) -> None:
        """The inner tree takes another shape; the chain stays."""
        self.inner.resize(depth, total_tokens)
        self.depth, self.total_tokens = chained_shape(self.inner, self.tokens)

    def start(self, prompts: list[torch.Tensor], hidden: list[torch.Tensor], tokens: torch.Tensor) -> None:
        self.contexts = [Context(self.capacity) for _ in prompts]
        for context, ids, token in zip(self.contexts, prompts, tokens, strict=True):
            context.reset(torch.cat((ids, token[None])))
        self.limits, self.offered = [self.earn or 0] * len(prompts), [[] for _ in prompts]
        self.inner.start(prompts, hidden, tokens)

    def read(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        for context, row in zip(self.contexts, tokens, strict=True):
            context.append(row)
        self.inner.read(tokens, features)

    def promising(self) -> bool:
        """Whether a probe may pay now: every row's context repeats its last n-gram (of the sizes the chains look
        up), so that every row's chain has something to copy. A batch takes as many cycles as its slowest row, and
        where its size's tuner kept no tree the head's tree alone does not pay: on MT-Bench, probes where some row
        repeated neither its last 3-gram nor its last 2-gram gave the slowest row 1.0-1.6 tokens
        (``benchmarks/results/batch-adapt/gate.md``). Asking for the 3-gram alone lost the gains of second turns at
        batch 4 (``benchmarks/results/batch-adapt/README.md``). Only with ``trim``: elsewhere reading the contexts
        would cost a host sync per row, so a probe always runs."""
        return not self.trim or all(bool(context.lookup(1, self.ngrams)[1][0]) for context in self.contexts)

    def propose(self, roots: torch.Tensor) -> Tree:
        found = [context.lookup(self.tokens, self.ngrams) for context in self.contexts]
        chains, valid = torch.stack([c for c, _ in found]), torch.stack([v for _, v in found])  # [B, K] each
        trees = self.inner.propose(roots)
        if self.trim:
            if self.earning:
                earned = torch.tensor(self.limits, device=valid.device)[:, None]
                valid &= torch.arange(self.tokens, device=valid.device) < earned  # [B, K] what each row has earned
            counts = valid.sum(dim=1).tolist()  # each row's real tokens are a prefix
            if self.earning:
                self.offered = [row[:n] for row, n in zip(chains.tolist(), counts, strict=True)]
            real = max(counts)
            if real == 0:
                return trees
            chains, valid = chains[:, :real], valid[:, :real]
        return graft(trees, chains, valid)  # each row's chain onto its own tree

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor, counts: list[int], device_counts: torch.Tensor
               ) -> None:
        for context, row, n in zip(self.contexts, tokens, counts, strict=True):
            context.append(row[:n])
        if self.earning:
            for b, (offered, row, n) in enumerate(zip(self.offered, tokens.tolist(), counts, strict=True)):
                if offered:
                    taken = next((i for i, (a, t) in enumerate(zip(offered, row[:n])) if a != t), min(len(offered), n))
                    self.limits[b] = min(self.tokens, 2 * self.limits[b]) if taken == len(offered) else max(1, taken)
            self.offered = [[] for _ in self.offered]
        self.inner.accept(tokens, hidden, counts, device_counts)

    def select(self, rows: list[int]) -> None:
        self.contexts = [self.contexts[r] for r in rows]
        if self.earning:
            self.limits, self.offered = [self.limits[r] for r in rows], [self.offered[r] for r in rows]
        self.inner.select(rows)


class BatchOracle:
    """:class:`griffin.drafters.OracleDrafter` in chain mode for B rows: row b proposes the next ``tokens`` tokens of
    ``continuations[b]`` (what a reference run of that row produced), padded where the reference runs out. Measures
    the batched engine's ceiling: a chain of K tokens per row accepts K+1 tokens per cycle wherever the target agrees
    with its reference."""

    def __init__(self, continuations: list[list[int]], tokens: int):
        self.continuations, self.depth = continuations, tokens
        self.total_tokens = tokens
        self.rows: list[int] = []  # the reference of each row still in the batch
        self.done: list[int] = []  # reference tokens each row has emitted, on the host

    def start(self, prompts: list[torch.Tensor], hidden: list[torch.Tensor], tokens: torch.Tensor) -> None:
        if len(prompts) != len(self.continuations):
            raise ValueError("a row finished at its first token: give the oracle budgets above 1 and no EOS")
        self.rows, self.done = list(range(len(prompts))), [1] * len(prompts)

    def propose(self, roots: torch.Tensor) -> Tree:
        k, device = self.depth, roots.device
        found = [self.continuations[r][n : n + k] for r, n in zip(self.rows, self.done, strict=True)]
        chains = torch.tensor([c + [0] * (k - len(c)) for c in found], device=device)  # [B, K]
        valid = torch.arange(k, device=device)[None, :] < torch.tensor([len(c) for c in found], device=device)[:, None]
        zeros = torch.zeros_like(roots)[:, None]  # [B, 1]: each row's tree is its root alone, the chain grafted on
        roots_only = Tree(roots[:, None], zeros, zeros, torch.ones_like(zeros, dtype=torch.bool)[..., None], zeros, 0)
        return graft(roots_only, chains, valid)

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor, counts: list[int], device_counts: torch.Tensor
               ) -> None:
        self.done = [n + c for n, c in zip(self.done, counts, strict=True)]

    def read(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        self.done = [n + 1 for n in self.done]

    def promising(self) -> bool:
        return True

    def select(self, rows: list[int]) -> None:
        self.rows, self.done = [self.rows[r] for r in rows], [self.done[r] for r in rows]


def batch_drafter(draft: DraftModel, depth: int, top_k: int, total_tokens: int, rows: int, capacity: int,
                  lookup: int = 0, ngrams: tuple[int, ...] | None = None, trim: bool = False,
                  earn: int | None = EARN_FROM) -> BatchHeadDrafter | BatchPromptLookup:
    """A :class:`BatchHeadDrafter` for ``rows`` rows of up to ``capacity`` positions, inside a
    :class:`BatchPromptLookup` of ``lookup`` tokens (its ``ngrams``, ``trim`` and ``earn``) when ``lookup`` > 0."""
    head = BatchHeadDrafter(draft, depth, top_k, total_tokens, rows, capacity)
    return BatchPromptLookup(head, lookup, capacity, ngrams, trim, earn) if lookup else head


def emitted_rows(tree: Tree, path: torch.Tensor, length: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """[B, D+1] each row's accepted tokens, then its bonus, then padding (:meth:`griffin.verify.Acceptance.emitted`)."""
    drafted = torch.cat((tree.tokens.gather(1, path[:, 1:]), bonus[:, None]), dim=1)
    at_bonus = torch.arange(path.shape[1], device=path.device)[None, :] == length[:, None]
    return torch.where(at_bonus, bonus[:, None], drafted)


def counted_rows(out: torch.Tensor, length: torch.Tensor, eos: torch.Tensor,
                 remaining: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`griffin.decode.emitted_count` for B rows: out [B, D+1], length [B], remaining [B] -> (count [B],
    stop [B] long)."""
    steps = torch.arange(out.shape[1], device=out.device)[None, :]
    hit = torch.isin(out, eos) & (steps <= length[:, None])
    first_eos = torch.where(hit, steps, out.shape[1]).min(dim=1).values
    count = torch.minimum(torch.minimum(length, first_eos), remaining - 1) + 1
    stop = (first_eos < out.shape[1]) | (count == remaining)
    return count, stop.long()


def pick(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token after each position, logits [.., V] -> [..]: the argmax, or one draw per position (the
    rule of :class:`griffin.verify.TreeSampling`)."""
    return greedy(logits) if sampling.greedy else sample(warp(logits, sampling), generator)


@torch.inference_mode()
def decode_rows(backend: TargetBackend, drafter: BatchHeadDrafter | BatchPromptLookup | None,
                prompts: list[torch.Tensor], budgets: list[int], sampling: SamplingConfig, eos: torch.Tensor,
                generator: torch.Generator | None, stats: GenerationStats,
                policy: ShapePolicy | None = None) -> list[list[int]]:
    """prompts [P_b] -> each row's new tokens (up to and including its first EOS, at most ``budgets[b]``).

    ``drafter`` None: the batched plain loop. ``policy``: the batch adapts its tree shape as one request does
    (:class:`griffin.adapt.ShapePolicy`, observing the tokens a cycle emitted in each row): each cycle drafts the
    shape it asks for, or is a plain step of every row, whose tokens the drafter reads before the next tree (the
    drafter is made for the largest shape). ``stats`` counts per row and cycle (``tau``: tokens per row per target
    pass; ``prefill_s``: the prompts' prefill and first tokens, ``wall_s``: all). One host sync per cycle; rows that
    finish leave the batch."""
    started = time.perf_counter()
    device = eos.device
    extra = drafter.total_tokens + 1 if drafter is not None else 1
    cache = RowsCache(backend.num_layers, max(p.shape[0] for p in prompts) + max(budgets) + extra)
    cache.lengths = [0] * len(prompts)
    hidden, last = [], []
    for row, ids in enumerate(prompts):  # each prompt alone, as a one-prompt generation prefills it
        one = BufferCache(backend.num_layers, ids.shape[0])
        features, logits = backend.prefill(ids, one)
        cache.fill(row, one)
        hidden.append(features)
        last.append(logits[-1])
    tokens = pick(torch.stack(last), sampling, generator)  # [B]
    host = torch.cat((tokens, torch.isin(tokens, eos).long())).tolist()  # host sync
    stats.prefill_s += time.perf_counter() - started
    out = [[t] for t in host[: len(prompts)]]
    active = [r for r, stop in enumerate(host[len(prompts) :]) if not stop and budgets[r] > 1]
    stats.new_tokens += len(prompts)
    if len(active) < len(prompts):
        tokens = tokens[active]
        if not active:
            stats.wall_s += time.perf_counter() - started
            return out
        cache.select(active)
    if drafter is not None:
        drafter.start([prompts[r] for r in active], [hidden[r] for r in active], tokens)
    remaining = torch.tensor([budgets[r] - 1 for r in active], device=device)  # [B] on the device from here on
    shape = policy.shape() if policy is not None and drafter is not None else None
    while True:
        b = len(active)
        tree_cycle = drafter is not None and shape is not PLAIN
        # a probe where the tuner kept no tree (always, for a batch that adapts) runs only where the drafter sees a use
        if tree_cycle and shape is not None and policy.plain_first and policy.probing:
            tree_cycle = drafter.promising()
        if not tree_cycle:
            tokens, features = plain_rows_step(backend, cache, tokens, sampling, generator)
            counts, stops = torch.ones_like(tokens), torch.isin(tokens, eos) | (remaining == 1)
            emitted = tokens[:, None]
            if drafter is not None:
                drafter.read(emitted, features)
        else:
            if shape is not None:
                drafter.resize(shape.depth, shape.total_tokens)
                stats.shapes[shape.name] = stats.shapes.get(shape.name, 0) + 1
            end = cache.end
            tree = drafter.propose(tokens)
            positions = cache.positions(device)[:, None] + tree.depths
            features, logits = backend.forward_rows(tree.tokens, positions, tree.ancestors, cache)
            path, length, bonus = follow_rows(tree, pick(logits, sampling, generator))
            emitted = emitted_rows(tree, path, length, bonus)  # [B, D+1]
            counts, stops = counted_rows(emitted, length, eos, remaining)
        width = emitted.shape[1]
        host = torch.cat((emitted.flatten(), counts, stops.long())).tolist()  # the host sync
        index, remaining = counts - 1, remaining - counts  # [B] each, kept on the device
        device_counts, counts, stops = counts, host[b * width : b * width + b], host[b * width + b :]
        if tree_cycle:
            cache.compact(end + path, counts, device_counts)
        for i, row in enumerate(active):
            out[row] += host[i * width : i * width + counts[i]]
            stats.count(counts[i])
        if not tree_cycle:
            stats.plain_steps += b
        if shape is not None:
            width = tree.tokens.shape[1] if tree_cycle else None  # nodes per row verified
            policy.observe(shape if tree_cycle else PLAIN, dict(zip(active, counts)) if tree_cycle else 1, width)
            shape = policy.shape()
        keep = [i for i in range(b) if not stops[i]]
        if not keep:
            break
        if len(keep) < b:  # finished rows leave the batch
            active = [active[i] for i in keep]
            cache.select(keep)
            rows = torch.tensor(keep, device=device)
            emitted, index, remaining, device_counts = emitted[rows], index[rows], remaining[rows], device_counts[rows]
            if drafter is not None:
                drafter.select(keep)
            if tree_cycle:
                path, features = path[rows], features[rows]
        tokens = emitted.gather(1, index[:, None])[:, 0]
        if tree_cycle:
            c = max(counts[i] for i in keep)
            drafter.accept(emitted[:, :c], _gather_rows(features, path[:, :c]), [counts[i] for i in keep],
                           device_counts)
    stats.wall_s += time.perf_counter() - started
    return out

