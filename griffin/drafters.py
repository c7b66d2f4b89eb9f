"""Drafters propose the tokens of each cycle; a verifier decides which the target accepts (the cycle:
``docs/design.md``; the protocol: :class:`griffin.verify.Drafter`).

:class:`HeadDrafter` drafts with a trained head (EAGLE-2 dynamic tree). :class:`PromptLookup` adds to another
drafter's tree a chain copied from the context (prompt lookup), for text that repeats what came before.
:class:`NoDraft` proposes nothing (prompt lookup alone inside :class:`PromptLookup`; with no chain the generator runs
the plain loop instead). :class:`DraftLMDrafter` samples chains with a standalone draft LM (classic speculative
sampling). :class:`OracleDrafter` knows the answer in advance and measures the engine's ceiling.
"""

from __future__ import annotations

import torch

from .chain import ChainVerifier
from .draft import DraftModel, DraftOutput
from .draft_lm import DraftLM
from .kv_cache import BufferCache, DraftCache
from .sampling import SamplingConfig, greedy, sample, warp
from .tree import Tree, build_tree, chain, draft_tree, graft
from .verify import default_verifier
from .vocab import DraftVocab

MAX_CONTEXT_VOCAB = 2048  # default slots for context tokens in a reduced draft vocabulary
# prompt lookup's n-gram sizes, longest first: static chains, trimmed ones (benchmarks/results/chain-trim/)
NGRAMS, TRIMMED_NGRAMS = (3, 2, 1), (3, 2)


def head_drafter(draft: DraftModel, depth: int, top_k: int, total_tokens: int, capacity: int, lookup: int = 0,
                 ngrams: tuple[int, ...] | None = None, trim: bool = False) -> HeadDrafter | PromptLookup:
    """A new :class:`HeadDrafter` for a generation of up to ``capacity`` positions, inside a :class:`PromptLookup` of
    ``lookup`` tokens (its ``ngrams`` and ``trim``) when ``lookup`` > 0."""
    head = HeadDrafter(draft, depth, top_k, total_tokens, capacity)
    return PromptLookup(head, lookup, capacity, ngrams, trim) if lookup else head


def tree_nodes(depth: int, top_k: int, total_tokens: int) -> int:
    """Drafted nodes of an EAGLE-2 tree: ``total_tokens`` unless fewer candidates exist."""
    return min(total_tokens, top_k + (depth - 1) * top_k**2)


class HeadDrafter:
    """EAGLE-2 dynamic tree drafting with a GRIFFIN or EAGLE head and its own KV cache.

    Built once per generator and kept across generations (:meth:`prepare`): the draft vocabulary's lm_head rows and
    the draft KV cache are reused whenever they are large enough.
    """

    def __init__(self, draft: DraftModel, depth: int, top_k: int, total_tokens: int, capacity: int):
        self.draft = draft
        self.vocab = DraftVocab(draft)
        self.cache: DraftCache | None = None
        self.last: DraftOutput | None = None
        self.prepare(depth, top_k, total_tokens, capacity)

    def prepare(self, depth: int, top_k: int, total_tokens: int, capacity: int, context_tokens: int = 0) -> None:
        """Set the tree shape and make room for a generation of up to ``capacity`` positions, of which up to
        ``context_tokens`` distinct ones (default: ``capacity`` up to 2048, in steps of 256) may join a reduced draft
        vocabulary."""
        self.depth, self.top_k = depth, top_k
        self.total_tokens = tree_nodes(depth, top_k, total_tokens)
        needed = capacity + depth * top_k
        if self.cache is None or self.cache.keys.shape[2] < needed:
            cfg, weight = self.draft.config, self.draft.fusion.fc.weight
            self.cache = DraftCache(cfg.num_key_value_heads, cfg.head_dim, needed, weight.dtype, weight.device)
        self.cache.length = 0
        self.vocab.reserve(context_tokens or -(-min(capacity, MAX_CONTEXT_VOCAB) // 256) * 256)

    def resize(self, depth: int, total_tokens: int) -> None:
        """Draft trees of another shape from the next proposal on, keeping what was read (no deeper than the depth
        :meth:`prepare` made room for)."""
        if depth * self.top_k > self.cache.keys.shape[2] - self.cache.length:
            raise ValueError(f"depth {depth} needs a draft cache prepared for it")
        self.depth, self.total_tokens = depth, tree_nodes(depth, self.top_k, total_tokens)

    @torch.inference_mode()
    def start(self, ids: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> None:
        self.cache.length = 0
        self.vocab.add(ids)
        self.accept(torch.cat((ids[1:], token)), hidden)

    def propose(self, token: torch.Tensor) -> Tree:
        return draft_tree(self.draft, self.vocab, self.cache, token, self.last, self.depth, self.top_k,
                          self.total_tokens)

    @torch.inference_mode()
    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        # draft position t reads (feature F_t, token x_{t+1}); the cache holds every earlier position
        self.vocab.add(tokens)
        start = self.cache.length
        positions = torch.arange(start, start + tokens.shape[0], device=tokens.device)
        self.last = self.draft(tokens[None], hidden[None], positions[None], cache=self.cache)


class NoDraft:
    """Proposes nothing: the target verifies only the newest token and emits the next, which is plain decoding
    through the one loop (``total_tokens=0``). The tree tuner chooses it where no tree pays for what it costs, e.g.
    when sampling with a head that rarely guesses the sampled token; inside :class:`PromptLookup` it leaves the copied
    chain alone (prompt lookup decoding)."""

    depth = total_tokens = 0

    def start(self, ids: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> None:
        pass

    def propose(self, token: torch.Tensor) -> Tree:
        return chain(token, token[:0])

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        pass


def lookup_ngrams(tokens: int, ngrams: tuple[int, ...] | None, trim: bool) -> list[int]:
    """A prompt-lookup chain's n-gram sizes, longest first (None: the default for static or trimmed chains), checked
    with its ``tokens``."""
    ngrams = (TRIMMED_NGRAMS if trim else NGRAMS) if ngrams is None else ngrams
    if tokens < 1 or not ngrams or min(ngrams) < 1:
        raise ValueError("prompt lookup needs tokens >= 1 and n-gram sizes >= 1")
    return sorted(set(ngrams), reverse=True)


def chained_shape(inner, tokens: int) -> tuple[int, int]:
    """(depth, total_tokens) of ``inner``'s tree with a prompt-lookup chain of ``tokens`` grafted onto it."""
    return max(inner.depth, tokens), inner.total_tokens + tokens


class PromptLookup:
    """Another drafter's tree plus a chain of ``tokens`` context tokens: those that followed the latest earlier
    occurrence of the context's last n-gram (the longest n in ``ngrams`` that occurs), grafted below the tree's node
    that already spells their start (:func:`griffin.tree.graft`). A head drafts text it has learnt; the chain drafts
    text that is copied (a rewrite, a quote, code edited again), and verification takes whichever the target agrees
    with, in the same pass. Lossless like any deterministic draft.

    Static shapes (the default; what a GPU needs to never wait) verify all ``tokens`` chain nodes every cycle, padding
    included. With ``trim`` (on the CPU, where reading a tensor costs no sync) a proposal carries only the chain's
    real tokens that the tree does not already spell, so a cycle whose chain found nothing costs what the tree alone
    costs; since every verified node then costs time, a match needs ``ngrams`` of at least 2 tokens by default (a
    single token almost always occurs earlier, and what follows it rarely repeats)."""

    def __init__(self, inner, tokens: int, capacity: int, ngrams: tuple[int, ...] | None = None, trim: bool = False):
        self.inner, self.tokens, self.ngrams, self.trim = inner, tokens, lookup_ngrams(tokens, ngrams, trim), trim
        self._shape()
        self.context = Context(capacity)

    def _shape(self) -> None:
        self.depth, self.total_tokens = chained_shape(self.inner, self.tokens)

    def resize(self, depth: int, total_tokens: int) -> None:
        """The inner drafter's tree takes another shape (:meth:`HeadDrafter.resize`); the chain stays."""
        self.inner.resize(depth, total_tokens)
        self._shape()

    def verifier(self, sampling, generator):
        choose = getattr(self.inner, "verifier", None)
        return choose(sampling, generator) if choose else default_verifier(sampling, generator)

    def start(self, ids: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> None:
        self.context.reset(torch.cat((ids, token)))
        self.inner.start(ids, hidden, token)

    def propose(self, token: torch.Tensor) -> Tree:
        chain_tokens, valid = self.lookup()
        tree = self.inner.propose(token)
        if not self.trim:
            return graft(tree, chain_tokens, valid)
        real = int(valid.sum())  # the chain's real tokens are a prefix
        return (graft(tree, chain_tokens[:real], valid[:real]) if real else tree).compact()

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        self.context.append(tokens)
        self.inner.accept(tokens, hidden)

    def lookup(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the chain [tokens] and which of its tokens are real [tokens] (:meth:`Context.lookup`)."""
        return self.context.lookup(self.tokens, self.ngrams)

    def promising(self, pending: torch.Tensor) -> bool:
        """Whether a probe may pay now, the plain steps' ``pending`` tokens [n] not read yet: the context, with them,
        repeats its last n-gram (of the sizes the chain looks up), so that the chain has something to copy. As for a
        batch (:meth:`griffin.batch.BatchPromptLookup.promising`), asked only where the tuner kept no tree: there the
        head's tree alone does not pay. Only with ``trim``: elsewhere reading the context would cost a host sync."""
        if not self.trim:
            return True
        end = self.context.length
        self.context.append(pending)  # in place, then forgotten: accept writes the same tokens there again
        found = bool(self.context.lookup(1, self.ngrams)[1][0])
        self.context.length = end
        return found


class Context:
    """Every token of one generation so far (the newest last), and the chain prompt lookup copies from it."""

    def __init__(self, capacity: int):
        self.tokens = torch.zeros(capacity + 1, dtype=torch.long)
        self.length = 0

    def reset(self, tokens: torch.Tensor) -> None:
        self.tokens = self.tokens.to(tokens.device)
        self.length = 0
        self.append(tokens)

    def append(self, tokens: torch.Tensor) -> None:
        end = self.length + tokens.shape[0]
        if end > self.tokens.shape[0]:
            self.tokens = torch.cat((self.tokens, self.tokens.new_zeros(end)))
        self.tokens[self.length : end] = tokens
        self.length = end

    def lookup(self, size: int, ngrams: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the ``size`` tokens that followed the latest earlier occurrence of the context's last n-gram (the
        longest n in ``ngrams``, longest first, that occurs) [size], and which of them are real [size] (none without a
        match; a chain that reaches the newest token ends there), with tensor operations only."""
        n_ctx, context = self.length, self.tokens[: self.length]
        device = context.device
        start = torch.zeros((), dtype=torch.long, device=device)
        found = torch.zeros((), dtype=torch.bool, device=device)
        for n in ngrams:
            if n_ctx <= n:
                continue
            windows = context[: n_ctx - 1].unfold(0, n, 1)  # [n_ctx - n, n] every earlier n-gram with a successor
            hits = (windows == context[n_ctx - n :]).all(dim=1)
            latest = torch.where(hits, torch.arange(hits.shape[0], device=device), -1).max()
            start = torch.where(found, start, latest + n)
            found = found | hits.any()
        at = start + torch.arange(size, device=device)
        return context[at.clamp(max=n_ctx - 1)], found & (at < n_ctx)


class DraftLMDrafter:
    """Classic speculative sampling's drafter: the draft LM samples a chain of ``gamma`` tokens with its own KV cache
    (greedy: its argmax chain); the proposal carries the draft's warped distributions q for the p/q chain rule.

    The draft cache holds every emitted token the draft has read. A proposal feeds the tokens it has not read yet
    (the prompt at the first cycle, the last drafted token after a fully accepted chain, and the root), then
    ``gamma - 1`` drafted tokens; :meth:`accept` keeps the accepted ones and drops the rest.
    """

    def __init__(self, draft: DraftLM, gamma: int, capacity: int):
        self.draft = draft
        self.cache: BufferCache | None = None
        self.sampling, self.generator = SamplingConfig(), None
        self.prepare(gamma, capacity)

    def prepare(self, gamma: int, capacity: int) -> None:
        """Set γ and make room for a generation of up to ``capacity`` positions (the cache buffers are reused)."""
        self.depth = self.total_tokens = gamma
        needed = capacity + gamma + 2
        if self.cache is None:
            self.cache = BufferCache(self.draft.num_layers, needed)
        self.cache.prepare(needed)
        self.unread = torch.zeros(0, dtype=torch.long, device=self.draft.device)
        self.read = 0  # cache length after the fed tokens of the last proposal

    def verifier(self, sampling: SamplingConfig, generator: torch.Generator | None) -> ChainVerifier:
        """The p/q chain rule; the drafter samples its own tokens with the same settings and generator."""
        self.sampling, self.generator = sampling, generator
        return ChainVerifier(sampling, generator)

    def start(self, ids: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> None:
        self.cache.crop(0)
        self.unread = ids

    @torch.inference_mode()
    def propose(self, token: torch.Tensor) -> Tree:
        fed = torch.cat((self.unread, token))
        start = self.cache.length
        self.read = start + fed.shape[0]
        logits = self.draft.forward(fed, torch.arange(start, self.read, device=fed.device), self.cache)
        picks, qs = [], []
        for i in range(self.depth):
            if self.sampling.greedy:
                pick = greedy(logits, keepdim=True)  # [1]
            else:
                probs = warp(logits, self.sampling)  # [V']
                pick = sample(probs, self.generator).view(1)
                qs.append(probs)
            picks.append(pick)
            if i < self.depth - 1:
                position = torch.full((1,), self.read + i, dtype=torch.long, device=fed.device)
                logits = self.draft.forward(self.draft.to_target(pick), position, self.cache)
        tokens = self.draft.to_target(torch.cat(picks))  # [γ]
        self.drafted = tokens
        q = None
        if qs:
            q = self.draft.full(torch.stack(qs))  # [γ, V]
            q = torch.cat((q, q.new_zeros(1, q.shape[1])))  # row γ: nothing is sampled after the last token
        return chain(token, tokens, q=q)

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        accepted = tokens.shape[0] - 1  # drafted tokens accepted (the last emitted token is the target's)
        self.cache.crop(self.read + min(accepted, self.depth - 1))
        self.unread = self.drafted[self.depth - 1 :] if accepted == self.depth else self.drafted[:0]


class OracleDrafter:
    """Proposes the tokens a reference run produced (``continuation``), as a chain or inside a full-size tree.

    ``mode="chain"``: the next ``depth`` reference tokens. ``mode="tree"``: those tokens plus ``top_k - 1`` wrong
    siblings per level, trimmed to ``total_tokens`` nodes like a real tree. Used to measure the engine's ceiling and
    to test acceptance of long paths. Proposals near the end of the reference are padded to the static size.
    """

    def __init__(self, continuation: list[int], depth: int, top_k: int = 1, total_tokens: int | None = None,
                 mode: str = "chain", vocab_size: int | None = None):
        if mode not in ("chain", "tree"):
            raise ValueError("mode must be 'chain' or 'tree'")
        self.continuation = continuation
        self.depth, self.mode = depth, mode
        self.top_k = top_k if mode == "tree" else 1
        self.total_tokens = min(total_tokens or depth * self.top_k, depth * self.top_k)
        self.vocab_size = vocab_size
        self.done = 0  # reference tokens already emitted

    def start(self, ids: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> None:
        self.done = 1

    def propose(self, token: torch.Tensor) -> Tree:
        device = token.device
        truth = self.continuation[self.done : self.done + self.depth] or [0]
        if self.mode == "chain":
            truth = truth[: self.total_tokens]
            return chain(token, torch.tensor(truth, dtype=torch.long, device=device), self.total_tokens)
        tokens, scores, parents, levels = [], [], [], []
        previous = -1
        for level, right in enumerate(truth, start=1):
            first = len(tokens)
            tokens.append(right)
            scores.append(-0.01 * level)
            parents.append(previous)
            levels.append(level)
            for s in range(1, self.top_k):
                wrong = (right + s) % (self.vocab_size or (right + s + 1))
                tokens.append(wrong)
                scores.append(-1.0 * level - s)
                parents.append(previous)
                levels.append(level)
            previous = first

        def tensor(values):
            return torch.tensor(values, dtype=torch.long, device=device)

        return build_tree(token, tensor(tokens), torch.tensor(scores, device=device), tensor(parents),
                          tensor(levels), self.total_tokens, max_depth=self.depth)

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        self.done += tokens.shape[0]
