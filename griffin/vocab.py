"""The set of tokens a draft head can propose, and the lm_head rows that score them.

A head with a reduced draft vocabulary scores only its ``draft_vocab_size`` most frequent training tokens, which
makes each drafting step several times cheaper. With ``context_vocab`` (the default for reduced vocabularies) the
tokens of the current context join that set as they appear: most tokens outside a frequency-based vocabulary are
names and terms the conversation already used, and chat models repeat them. Which tokens can be proposed never
affects the output, only how many drafts are accepted.
"""

from __future__ import annotations

import torch


class DraftVocab:
    """Static draft tokens plus context tokens, with their lm_head rows kept in a growing preallocated buffer."""

    def __init__(self, draft, extra_capacity: int = 2048):
        weight = draft.lm_weight_full()  # [V, H]
        self.dtype = draft.fusion.fc.weight.dtype
        self.transform = draft.logits_transform  # the target's logits step, so that draft scores are on its scale
        static = draft.static_vocab().to(weight.device)
        self.dynamic = draft.config.context_vocab and draft.draft_vocab is not None
        capacity = static.shape[0] + (extra_capacity if self.dynamic else 0)
        self.full = weight
        self.member = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
        self.member[static] = True
        self.ids = torch.empty(capacity, dtype=torch.long, device=weight.device)
        self.ids[: static.shape[0]] = static
        self.weight = torch.empty(capacity, weight.shape[1], dtype=self.dtype, device=weight.device)
        self.weight[: static.shape[0]] = weight[static].to(self.dtype)
        self.size = static.shape[0]

    def add(self, tokens: torch.Tensor) -> None:
        """Make context tokens (target ids) proposable."""
        if not self.dynamic:
            return
        new = torch.unique(tokens[~self.member[tokens]])
        n = new.shape[0]
        if n == 0:
            return
        if self.size + n > self.ids.shape[0]:
            grow = max(n, self.ids.shape[0] // 2)
            self.ids = torch.cat((self.ids, torch.empty(grow, dtype=torch.long, device=self.ids.device)))
            self.weight = torch.cat((self.weight, self.weight.new_empty(grow, self.weight.shape[1])))
        self.ids[self.size : self.size + n] = new
        self.weight[self.size : self.size + n] = self.full[new].to(self.dtype)
        self.member[new] = True
        self.size += n

    def logits(self, predict: torch.Tensor) -> torch.Tensor:
        """predict [.., H] -> logits over the current draft tokens [.., size]."""
        return self.transform(predict.to(self.dtype) @ self.weight[: self.size].T)

    def to_target_ids(self, index: torch.Tensor) -> torch.Tensor:
        return self.ids[index]
