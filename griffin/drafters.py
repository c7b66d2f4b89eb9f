"""Drafters propose tokens each cycle; a verifier decides which the target accepts. The one generation loop
(``SpecGenerator._steps``) runs, per cycle::

    tree = drafter.propose(token)                       # a Tree (griffin.tree): tokens, ancestor mask, depths, q
    hidden, logits = backend.forward(tree.tokens, n + tree.depths, tree.ancestors)    # the target, one pass
    acceptance = verifier.accept(tree, logits)          # griffin.verify: path, length, bonus (on the device)
    backend.cache.keep(n, n + acceptance.path)          # KV compaction, one index copy
    ... the emitted tokens go to the host (the cycle's one host sync) ...
    drafter.accept(emitted, hidden[path[:count]])

A drafter is any object with:

- ``depth: int`` and ``total_tokens: int``: every proposal has exactly ``total_tokens + 1`` nodes (root included;
  pad with :func:`griffin.tree.build_tree` / :func:`griffin.tree.chain`) and no node deeper than ``depth``, so the
  shapes of a cycle never change;
- ``start(ids, hidden, token)``: the prompt ids [P], the target's features of the prompt [P, H], the first new token
  [1] (drafters with their own model, e.g. a draft LM, prefill it here);
- ``propose(token) -> Tree``: a tree rooted at ``token`` (the newest token, not yet seen by the target), built with
  tensor operations only (no ``.item()``, ``.tolist()``, ``nonzero`` or boolean indexing: the loop allows one host
  sync per cycle). A drafter that samples its tokens sets ``tree.q`` for rules that need the draft probabilities;
- ``accept(tokens, hidden)``: the tokens emitted this cycle [n] and the target's features of the positions that
  produced them [n, H];
- optionally ``verifier(sampling, generator) -> Verifier``: the acceptance rule its proposals need (default:
  :func:`griffin.verify.default_verifier`, greedy or the fixed-token tree rule). A draft LM that samples a chain
  returns the p/q chain rule there (see :mod:`griffin.verify`).

:class:`HeadDrafter` drafts with a trained head (EAGLE-2 dynamic tree). :class:`OracleDrafter` knows the answer in
advance and measures the engine's ceiling.
"""

from __future__ import annotations

import torch

from .draft import DraftModel, DraftOutput
from .kv_cache import DraftCache
from .tree import Tree, build_tree, chain, draft_tree
from .vocab import DraftVocab

MAX_CONTEXT_VOCAB = 2048  # default slots for context tokens in a reduced draft vocabulary


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
