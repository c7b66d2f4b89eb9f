"""Token-alignable training (TAT): K forward passes per batch, each pass reading the head's own earlier features.

Positions (EAGLE's shift): position ``t`` reads token ``x_{t+1}`` and feature ``F_t``; it regresses ``F_{t+1}`` and
predicts the target's distribution ``p_{t+1} = softmax(LM(F_{t+1}))`` of the token after ``x_{t+1}``.

Pass 1 reads target features everywhere (EAGLE training). Pass ``k`` reads, at position ``t``, the *version* ``k-1``
input: the regress feature pass ``k-1`` produced at ``t-1`` (detached). Its query at ``t`` attends to the key at
``s = t - d`` of version ``max(k-1-d, 0)``, i.e. the simulated drafting chain of the last ``k-1`` positions on top of
target features. The loss of pass ``k+1`` keeps position ``t`` only if pass ``k`` kept ``t-1`` and the true next token
was in pass ``k``'s top-``topk`` there (the alignment mask): the position is then on a branch the draft tree contains.

Shapes: B batch, T positions, H hidden, V draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from griffin.draft import DraftModel


def version_mixed_mask(pass_index: int, valid: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask of pass ``k`` (1-based) over keys of versions 0..k-1 concatenated in that order.

    valid [B, T] (True on real tokens) -> [B, 1, T, k*T]: query ``t`` may see key ``s`` of version ``j`` iff
    ``s <= t``, ``j == max(k-1-(t-s), 0)`` and ``s`` is not padding.
    """
    k = pass_index
    b, t = valid.shape
    pos = torch.arange(t, device=valid.device)
    d = pos[:, None] - pos[None, :]  # [T, T] query minus key position
    wanted = (k - 1 - d).clamp(min=0)  # version each key position must have for this query
    versions = torch.arange(k, device=valid.device)[:, None, None]  # [k, 1, 1]
    allowed = (d >= 0) & (wanted == versions)  # [k, T, T]
    allowed = allowed.permute(1, 0, 2).reshape(t, k * t)  # [T, k*T]
    return (allowed[None] & valid.repeat(1, k)[:, None, :])[:, None]  # [B, 1, T, k*T]


def next_masks(mask: torch.Tensor, aligned: torch.Tensor, data_mask: torch.Tensor) -> torch.Tensor:
    """``m^(k+1)_t = m^(k)_{t-1} * a^(k)_{t-1} * data_mask_t`` with ``m^(k+1)_0 = 0``; all [B, T] 0/1 floats."""
    carried = torch.zeros_like(mask)
    carried[:, 1:] = mask[:, :-1] * aligned[:, :-1]
    return carried * data_mask


@dataclass
class Batch:
    """A padded training batch built from stored features (see :func:`make_batch`)."""

    tokens: torch.Tensor  # [B, T] x_{t+1}: the token position t reads
    features: torch.Tensor  # [B, T, H] F_t
    targets: torch.Tensor  # [B, T, H] F_{t+1}
    next_tokens: torch.Tensor  # [B, T] x_{t+2} (the true next token; -1 where unknown)
    data_mask: torch.Tensor  # [B, T] 1 where x_{t+1} is an assistant token
    valid: torch.Tensor  # [B, T] bool, False on padding

    def to(self, device) -> Batch:
        return Batch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))

    @property
    def num_tokens(self) -> int:
        return int(self.valid.sum())


def make_batch(items, max_len: int | None = None) -> Batch:
    """Conversations (input_ids [L], loss_mask [L], hidden [L, H]) -> a right-padded :class:`Batch` of L-1 positions."""
    cut = [(c.input_ids[:max_len], c.loss_mask[:max_len], c.hidden[:max_len]) for c in items]
    width = max(len(ids) for ids, _, _ in cut) - 1
    hsize = cut[0][2].shape[-1]
    b = len(cut)
    tokens = torch.zeros(b, width, dtype=torch.long)
    next_tokens = torch.full((b, width), -1, dtype=torch.long)
    features = torch.zeros(b, width, hsize)
    targets = torch.zeros(b, width, hsize)
    data_mask = torch.zeros(b, width)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for i, (ids, mask, hidden) in enumerate(cut):
        n = len(ids) - 1
        tokens[i, :n] = ids[1:]
        next_tokens[i, : n - 1] = ids[2:]
        features[i, :n] = hidden[:-1].float()
        targets[i, :n] = hidden[1:].float()
        data_mask[i, :n] = mask[1:].float()
        valid[i, :n] = True
    return Batch(tokens, features, targets, next_tokens, data_mask, valid)


class MultiPassObjective(nn.Module):
    """Wraps a draft head; ``forward(batch)`` runs the K passes and returns per-pass loss sums and counts.

    Per-pass losses are sums over kept positions; the caller divides by the (globally reduced) counts so that the
    gradient equals the mean over the global batch regardless of how it is split across processes.
    """

    def __init__(self, draft: DraftModel, steps: int, topk: int, w_regress: float = 1.0, w_token: float = 0.1,
                 noise: float = 0.2):
        super().__init__()
        if steps < 1:
            raise ValueError("steps must be at least 1")
        if topk < 0:
            raise ValueError("topk must be >= 0 (0 = no token mask)")
        self.draft = draft
        self.steps, self.topk = steps, topk
        self.w_regress, self.w_token, self.noise = w_regress, w_token, noise
        self.report_k = topk or 3  # the top-k accuracy reported (HASS, without a token mask, still reports top-3)

    def forward(self, batch: Batch, vocab: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """``vocab``: target ids the head may propose for this batch (default: its static draft vocabulary)."""
        draft = self.draft
        b, t = batch.tokens.shape
        device = batch.tokens.device
        position_ids = torch.arange(t, device=device)[None].expand(b, t)
        vocab = draft.static_vocab().to(device) if vocab is None else vocab
        weight = draft.lm_weight_full()[vocab]  # [V, H] frozen lm_head rows of the proposable tokens
        with torch.no_grad():
            p = F.softmax(F.linear(batch.targets, weight).float(), dim=-1)  # [B, T, V] target distribution
        to_local = torch.full((draft.config.vocab_size,), -1, dtype=torch.long, device=device)
        to_local[vocab] = torch.arange(vocab.shape[0], device=device)
        gt = torch.where(batch.next_tokens >= 0, to_local[batch.next_tokens.clamp(min=0)], -1)  # [B, T], -1: absent
        features = batch.features
        if self.training and self.noise > 0:
            u = torch.rand(features.shape, generator=generator, device=features.device, dtype=features.dtype)
            features = features + (u - 0.5) * self.noise * 512 / t
        mask = batch.data_mask * batch.valid
        keys, values = [], []
        sums, counts, top1, topk_hits = [], [], [], []
        for k in range(1, self.steps + 1):
            h = draft.fuse(batch.tokens, features)
            past = (torch.cat(keys, dim=2), torch.cat(values, dim=2)) if keys else None
            attn_mask = version_mixed_mask(k, batch.valid)
            out = draft.forward_fused(h, position_ids, attn_mask, past_kv=past)
            keys.append(out.key)
            values.append(out.value)
            logits = F.linear(out.predict, weight.to(out.predict.dtype)).float()  # [B, T, V]
            token_loss = -(p * F.log_softmax(logits, dim=-1)).sum(-1)
            regress_loss = F.smooth_l1_loss(out.regress.float(), batch.targets, reduction="none").mean(-1)
            loss = self.w_regress * regress_loss + self.w_token * token_loss
            sums.append((loss * mask).sum())
            counts.append(mask.sum())
            with torch.no_grad():
                ranked = logits.topk(min(self.report_k, logits.shape[-1]), dim=-1).indices  # [B, T, k]
                hit1 = (ranked[..., 0] == gt).float()
                hitk = (ranked == gt[..., None]).any(-1).float()
                top1.append((hit1 * mask).sum())
                topk_hits.append((hitk * mask).sum())
                if k < self.steps:
                    aligned = hitk if self.topk else torch.ones_like(hitk)  # topk 0: no token mask (HASS)
                    mask = next_masks(mask, aligned, batch.data_mask * batch.valid)
                    shifted = torch.zeros_like(out.regress)
                    shifted[:, 1:] = out.regress[:, :-1].detach()
                    shifted[:, 0] = features[:, 0]
                    features = shifted
        return {"loss_sums": torch.stack(sums), "counts": torch.stack(counts), "top1": torch.stack(top1),
                "topk": torch.stack(topk_hits)}
