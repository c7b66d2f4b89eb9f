"""Drafters propose a token tree each cycle; the generator verifies it. Any object with this interface plugs in:

- ``start(ids, hidden, token)``: the prompt ids [P], the target's features of the prompt [P, H], the first new token;
- ``propose(token) -> Tree``: a tree rooted at ``token`` (the newest token, not yet seen by the target);
- ``accept(tokens, hidden)``: the tokens emitted this cycle [n] and the target's features of the positions that
  produced them [n, H].

:class:`HeadDrafter` drafts with a trained head (EAGLE-2 dynamic tree). :class:`OracleDrafter` knows the answer in
advance and measures the engine's ceiling.
"""

from __future__ import annotations

import torch

from .draft import DraftModel, DraftOutput
from .kv_cache import DraftCache
from .tree import Tree, build_tree, draft_tree
from .vocab import DraftVocab


class HeadDrafter:
    """EAGLE-2 dynamic tree drafting with a GRIFFIN or EAGLE head and its own KV cache."""

    def __init__(self, draft: DraftModel, depth: int, top_k: int, total_tokens: int, capacity: int):
        self.draft, self.depth, self.top_k, self.total_tokens = draft, depth, top_k, total_tokens
        cfg = draft.config
        self.cache = DraftCache(cfg.num_key_value_heads, cfg.head_dim, capacity + depth * top_k,
                                draft.fusion.fc.weight.dtype, draft.fusion.fc.weight.device)
        self.vocab = DraftVocab(draft)
        self.last: DraftOutput | None = None

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
    to test acceptance of long paths.
    """

    def __init__(self, continuation: list[int], depth: int, top_k: int = 1, total_tokens: int | None = None,
                 mode: str = "chain", vocab_size: int | None = None):
        if mode not in ("chain", "tree"):
            raise ValueError("mode must be 'chain' or 'tree'")
        self.continuation = continuation
        self.depth, self.top_k, self.mode = depth, top_k, mode
        self.total_tokens = total_tokens or depth * top_k
        self.vocab_size = vocab_size
        self.done = 0  # reference tokens already emitted

    def start(self, ids: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> None:
        self.done = 1

    def propose(self, token: torch.Tensor) -> Tree:
        device = token.device
        truth = self.continuation[self.done : self.done + self.depth] or [0]
        siblings = self.top_k - 1 if self.mode == "tree" else 0
        tokens, scores, parents, levels = [], [], [], []
        previous = -1
        for level, right in enumerate(truth, start=1):
            first = len(tokens)
            tokens.append(right)
            scores.append(-0.01 * level)
            parents.append(previous)
            levels.append(level)
            for s in range(1, siblings + 1):
                wrong = (right + s) % (self.vocab_size or (right + s + 1))
                tokens.append(wrong)
                scores.append(-1.0 * level - s)
                parents.append(previous)
                levels.append(level)
            previous = first

        def tensor(values):
            return torch.tensor(values, dtype=torch.long, device=device)

        return build_tree(token, tensor(tokens), torch.tensor(scores, device=device), tensor(parents),
                          tensor(levels), self.total_tokens)

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        self.done += tokens.shape[0]
