"""The set of tokens a draft head can propose, and the lm_head rows that score them.

A head with a reduced draft vocabulary scores only its ``draft_vocab_size`` most frequent training tokens, which
makes each drafting step several times cheaper. With ``context_vocab`` (the default for reduced vocabularies) the
tokens of the current context join that set as they appear: most tokens outside a frequency-based vocabulary are
names and terms the conversation already used, and chat models repeat them. Which tokens can be proposed never
affects the output, only how many drafts are accepted.

The context tokens live in a fixed number of slots after the static ones; unused slots score -inf (a logit mask), so
drafting always multiplies by the same [capacity, H] matrix and adding tokens never waits for the device.
"""

from __future__ import annotations

import torch


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class DraftVocab:
    """Static draft tokens plus up to ``extra_capacity`` context tokens, with their lm_head rows.

    ``ids`` [capacity + 1] target id of each slot (the last slot is scratch, never scored); ``slot_of`` [V + 1]:
    slot + 1 of each target id, 0 when it is not proposable; ``size`` (0-dim tensor): slots in use.
    """

    def __init__(self, draft, extra_capacity: int = 256):
        full = draft.lm_weight_full()  # [V, H]
        self.full, self.vocab_size = full, full.shape[0]
        self.dtype = draft.fusion.fc.weight.dtype
        self.transform = draft.logits_transform  # the target's logits step, so that draft scores are on its scale
        device = full.device
        static = draft.static_vocab().to(device)
        self.static_size = static.shape[0]
        self.dynamic = bool(draft.config.context_vocab and draft.draft_vocab is not None)
        if draft.lm_head is not None:  # a trained lm_head over the draft vocabulary (EAGLE-3 generation), no transform
            self.weight, self.transform = draft.lm_head.weight.detach(), _identity
        elif not self.dynamic and self.static_size == self.vocab_size:
            self.weight = full if full.dtype == self.dtype else full.to(self.dtype)  # the whole lm_head, no copy
        else:
            self.weight = full[static].to(self.dtype)
        self.ids = static
        self.bias: torch.Tensor | None = None
        self.slot_of = torch.zeros(self.vocab_size + 1, dtype=torch.long, device=device)
        self.slot_of[static] = torch.arange(1, self.static_size + 1, device=device)
        self.size = torch.tensor(self.static_size, device=device)
        self.capacity = self.static_size
        if self.dynamic:
            self.reserve(extra_capacity)

    def reserve(self, extra_capacity: int) -> None:
        """Make room for at least ``extra_capacity`` context tokens (grows, never shrinks), and forget the current
        context tokens. Called before a generation, never while drafting."""
        if not self.dynamic:
            return
        extra = max(extra_capacity, self.capacity - self.static_size)
        capacity = self.static_size + extra
        device = self.full.device
        self.slot_of[self.ids[self.static_size : self.capacity]] = 0  # not the scratch slot's id: it may be static
        if capacity != self.capacity:
            h = self.full.shape[1]
            self.weight = torch.cat((self.weight[: self.static_size], self.weight.new_zeros(extra + 1, h)))
            self.capacity = capacity
        self.ids = torch.cat((self.ids[: self.static_size],
                              torch.full((extra + 1,), self.vocab_size, dtype=torch.long, device=device)))
        self.bias = torch.zeros(capacity + 1, dtype=self.dtype, device=device)
        self.bias[self.static_size :] = float("-inf")
        self.size.fill_(self.static_size)

    def add(self, tokens: torch.Tensor) -> None:
        """Make context tokens (target ids, [n]) proposable while free slots last. Tensor operations only."""
        if not self.dynamic:
            return
        tokens = tokens.sort().values
        first = torch.ones_like(tokens, dtype=torch.bool)
        first[1:] = tokens[1:] != tokens[:-1]
        new = first & (self.slot_of[tokens] == 0)  # [n] each new id once
        slot = self.size + new.cumsum(0) - 1
        write = new & (slot < self.capacity)
        slot = torch.where(write, slot, self.capacity)  # the rest goes to the scratch slot
        self.ids[slot] = tokens
        self.weight[slot] = self.full[tokens].to(self.dtype)
        self.bias[slot] = 0.0
        self.slot_of[torch.where(write, tokens, self.vocab_size)] = slot + 1
        self.size += write.sum()

    def logits(self, predict: torch.Tensor) -> torch.Tensor:
        """predict [.., H] -> logits over the draft slots [.., capacity] (-inf for unused slots), after the target's
        own logits step."""
        n = self.capacity
        logits = self.transform(torch.nn.functional.linear(predict.to(self.dtype), self.weight[:n]))
        return logits if self.bias is None else logits + self.bias[:n]

    def to_target_ids(self, index: torch.Tensor) -> torch.Tensor:
        return self.ids[index]
