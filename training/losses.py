"""Token-level distillation objectives between the target distribution p and the draft distribution q.

Used by every trainer (draft heads and standalone draft LMs): a :class:`TokenLoss` maps target logits, draft logits and
a mask of the positions to train on to a per-position loss; the caller reduces (sum / count).

    loss = make_token_loss("tvd", temperature=1.0)
    per_position = loss(target_logits, draft_logits, mask)  # [..., V], [..., V], [...] -> [...] fp32

Objectives (docs/design.md#distillation-objectives; p, q at the same temperature):

- ``soft-ce``  ``-Σ p log q`` (the heads' default; FKL plus the entropy of p, so the same gradient)
- ``fkl``      ``Σ p log(p/q)``
- ``rkl``      ``Σ q log(q/p)``
- ``jsd``      ``β·KL(p‖m) + (1−β)·KL(q‖m)`` with ``m = βp + (1−β)q``
- ``tvd``      ``½ Σ |p − q|`` (a draft's acceptance rate is ``1 − TVD``)
- ``tvdpp``    TVD++: ``−Σ_v q(v)·sg((r(v) − μ)/σ)`` with reward ``r(v) = 1[p(v) > q(v)]``, ``μ, σ`` the mean and
  standard deviation of ``r`` over the masked positions × their vocabulary (tokens with a finite target or draft logit)

Everything is computed in fp32 from log-softmax (soft-CE from the log-sum-exp), so a logit gap too large for ``exp``
stays exact. Logits of ``-inf`` (a reduced draft vocabulary, a context-vocabulary mask) give exact zeros, and every
``0·log 0`` term counts as 0: no NaN, no inf, and no gradient through them. A divergence is infinite only where it truly
is: FKL / soft-CE where ``p > 0 = q``, RKL where ``q > 0 = p``; the trainers mask both distributions with the same
vocabulary.

A head with its own linear lm_head trained by soft-CE is scored by :class:`LinearSoftCrossEntropy`, which takes the
head's hidden states and weight instead of its logits and never holds them in fp32 (the loss and its gradient as
above, chunk by chunk).

AdaSPEC token selection: :func:`per_token_fkl` scores the draft and a frozen reference; :func:`adaspec_select` keeps
the positions where the draft lags the reference most (``Δ = L_draft − L_ref``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from griffin.constants import TOKEN_LOSSES

Tensor = torch.Tensor
NAMES = TOKEN_LOSSES


def scaled(logits: Tensor, keep: Tensor, temperature: float = 1.0) -> Tensor:
    """logits [..., V] -> fp32 logits / temperature; rows outside ``keep`` [...] are replaced by zeros (uniform) first,
    so that an all ``-inf`` padding row cannot produce NaN in the value or the gradient."""
    x = logits.float()
    if not bool(keep.all()):  # a head's rollout passes only kept rows: no full-size copy then
        x = torch.where(keep[..., None], x, 0.0)
    return x / temperature if temperature != 1.0 else x


def log_probs(logits: Tensor, keep: Tensor, temperature: float = 1.0) -> Tensor:
    return F.log_softmax(scaled(logits, keep, temperature), dim=-1)


def kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """``Σ a log(a/b)`` over the last dim with ``0·log(0/·) = 0``; log-probabilities [..., V] -> [...]."""
    a = log_a.exp()
    diff = torch.where(a > 0, log_a - log_b, 0.0)  # finite wherever a = 0, so no 0·inf in value or gradient
    return (a * diff).sum(-1)


class SoftCrossEntropy(torch.autograd.Function):
    """``-Σ p log softmax(x)`` per row: logits x [N, V] fp32 (``-inf`` where p = 0 is fine), probabilities p [N, V]
    -> [N], as ``lse(x)·Σp − Σ p·x`` (``nansum`` drops the ``0·(−inf)`` terms and keeps ``p·(−inf)``: infinite
    where p > 0 = q). The forward keeps the unnormalised softmax it computes anyway, and the backward is
    ``g·(softmax(x)·Σp − p)`` from it without another ``exp``: the composed form (log-softmax, mask, product, sum and
    their backward) spends about a third more time in these [N, V] passes, a large share of a head's update on a CPU."""

    @staticmethod
    def forward(ctx, x: Tensor, p: Tensor) -> Tensor:
        top = x.amax(-1, keepdim=True)  # [N, 1]
        e = (x - top).exp_()  # [N, V] softmax(x) · s
        s = e.sum(-1, keepdim=True)
        mass = p.sum(-1)
        ctx.save_for_backward(e, s, p, mass)
        return (top + s.log())[:, 0] * mass - torch.nansum(p * x, -1)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        e, s, p, mass = ctx.saved_tensors
        return (e * (g * mass)[:, None].div(s)).addcmul_(p, g[:, None], value=-1.0), None


CHUNK_BITS = 20  # fp32 elements per chunk on a CPU, log2: 4 MB, 128 rows of an 8,192-token draft vocabulary


def chunk_rows(vocab: int, device: torch.device) -> int:
    """Rows per chunk of :class:`LinearSoftCrossEntropy`'s fp32 work: a few MB of [rows, V] temporaries on a CPU,
    where the allocator reuses them (a fresh [N, V] tensor costs a page fault per 4 KB); larger on a GPU."""
    return max(1, (1 << CHUNK_BITS if device.type == "cpu" else 1 << 26) // vocab)


class LinearSoftCrossEntropy(torch.autograd.Function):
    """Soft cross-entropy of a linear head, ``-Σ p log softmax(h Wᵀ)`` per row, and the head's top-``k`` tokens per
    row. The logits stay in the product's dtype (bf16 under autocast, as ``nn.Linear`` gives them) and only chunks of
    rows (:func:`chunk_rows`) are ever fp32: the softmax, the loss and the logits' gradient run chunk by chunk, where
    :class:`SoftCrossEntropy` over ``(h Wᵀ).float()`` allocates and faults in a fresh fp32 [N, V] tensor at each
    step (benchmarks/results/train-step.md). The logits are finite here (no vocabulary mask).

    hidden [N, H], weight [V, H], probs [M, V] fp32 soft labels (rows of several calls may share them), index [N]
    rows of ``probs`` -> loss [N] fp32, top-k [N, k] token indices (not differentiable)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, probs: Tensor, index: Tensor, k: int) -> tuple[Tensor, Tensor]:
        device = hidden.device
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
        w, h = weight.to(dtype), hidden.to(dtype)
        logits = h @ w.T  # [N, V] in the product's dtype
        n, step = logits.shape[0], chunk_rows(logits.shape[1], device)
        loss = torch.empty(n, device=device)
        top = torch.empty(n, min(k, logits.shape[1]), dtype=torch.long, device=device)
        for i in range(0, n, step):
            x, p = logits[i : i + step].float(), probs[index[i : i + step]]  # [c, V]
            top[i : i + step] = x.topk(top.shape[1], dim=-1).indices
            peak = x.amax(-1, keepdim=True)
            lse = (x - peak).exp_().sum(-1).log_() + peak[:, 0]
            loss[i : i + step] = lse * p.sum(-1) - (p * x).sum(-1)
        ctx.save_for_backward(h, w, logits, probs, index)
        ctx.types = hidden.dtype, weight.dtype
        ctx.mark_non_differentiable(top)
        return loss, top

    @staticmethod
    def backward(ctx, g: Tensor, _top: Tensor | None) -> tuple[Tensor, Tensor, None, None, None]:
        h, w, logits, probs, index = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [N, V]: g·(softmax(x)·Σp − p), a chunk at a time in fp32
        step = chunk_rows(logits.shape[1], logits.device)
        for i in range(0, logits.shape[0], step):
            x, p = logits[i : i + step].float(), probs[index[i : i + step]]  # x: the saved logits where fp32
            x = (x - x.amax(-1, keepdim=True)).exp_()
            grad[i : i + step] = x.mul_((p.sum(-1) / x.sum(-1))[:, None]).sub_(p).mul_(g[i : i + step, None])
        return (grad @ w).to(ctx.types[0]), (grad.T @ h).to(ctx.types[1]), None, None, None


def fkl(log_p: Tensor, log_q: Tensor) -> Tensor:
    return kl(log_p, log_q)


def rkl(log_p: Tensor, log_q: Tensor) -> Tensor:
    return kl(log_q, log_p)


def jsd(log_p: Tensor, log_q: Tensor, beta: float) -> Tensor:
    a, b = log_p + math.log(beta), log_q + math.log1p(-beta)
    empty = (a == -torch.inf) & (b == -torch.inf)  # logaddexp's gradient is NaN there, so keep it out
    log_m = torch.where(empty, -torch.inf, torch.logaddexp(a.masked_fill(empty, 0), b.masked_fill(empty, 0)))
    return beta * kl(log_p, log_m) + (1 - beta) * kl(log_q, log_m)


def tvd(log_p: Tensor, log_q: Tensor) -> Tensor:
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def tvdpp(log_p: Tensor, log_q: Tensor, support: Tensor) -> Tensor:
    """``support`` [..., V] bool: the (masked position, token) pairs the reward statistics are taken over."""
    p, q = log_p.exp(), log_q.exp()
    with torch.no_grad():
        reward = (p > q).float()
        n = support.sum().clamp(min=1)
        mean = (reward * support).sum() / n
        std = (((reward - mean) ** 2 * support).sum() / n).sqrt()
        advantage = torch.where(support, (reward - mean) / std.clamp(min=1e-6), 0.0)
    return -(q * advantage).sum(-1)


@dataclass(frozen=True)
class TokenLoss:
    """``loss(target_logits [..., V], draft_logits [..., V], mask [...]) -> [...]`` fp32, 0 outside the mask."""

    name: str
    temperature: float = 1.0
    jsd_beta: float = 0.5

    def __call__(self, target_logits: Tensor, draft_logits: Tensor, mask: Tensor) -> Tensor:
        keep = mask.bool()
        with torch.no_grad():
            target = scaled(target_logits.detach(), keep, self.temperature)
        if self.name == "soft-ce":  # softmax, not exp(log_softmax), for p: the heads' historical labels
            draft = scaled(draft_logits, keep, self.temperature)  # [..., V]
            p = F.softmax(target, dim=-1)
            loss = SoftCrossEntropy.apply(draft.reshape(-1, draft.shape[-1]), p.reshape(-1, p.shape[-1]))
            return torch.where(keep, loss.view(keep.shape), 0.0)
        log_q = log_probs(draft_logits, keep, self.temperature)
        log_p = F.log_softmax(target, dim=-1)
        if self.name == "tvdpp":
            finite = torch.isfinite(target_logits) | torch.isfinite(draft_logits)
            loss = tvdpp(log_p, log_q, finite & keep[..., None])
        elif self.name == "jsd":
            loss = jsd(log_p, log_q, self.jsd_beta)
        else:
            loss = PAIRWISE[self.name](log_p, log_q)
        return torch.where(keep, loss, 0.0)


PAIRWISE: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"fkl": fkl, "rkl": rkl, "tvd": tvd}


def make_token_loss(name: str, temperature: float = 1.0, jsd_beta: float = 0.5) -> TokenLoss:
    """The objective ``name`` (one of :data:`NAMES`) at ``temperature`` (> 0); ``jsd_beta`` in (0, 1) for ``jsd``."""
    if name not in NAMES:
        raise ValueError(f"unknown token loss {name!r}: choose one of {', '.join(NAMES)}")
    if not temperature > 0:
        raise ValueError(f"the temperature must be > 0, got {temperature}")
    if not 0 < jsd_beta < 1:
        raise ValueError(f"the JSD β must be in (0, 1), got {jsd_beta} (at 0 or 1 JSD is identically 0)")
    return TokenLoss(name, float(temperature), float(jsd_beta))


def per_token_fkl(target_logits: Tensor, draft_logits: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-position ``KL(p‖q)`` at temperature 1 [...] (AdaSPEC's token score); 0 outside ``mask`` if given."""
    keep = torch.ones(target_logits.shape[:-1], dtype=torch.bool, device=target_logits.device) if mask is None \
        else mask.bool()
    log_p = log_probs(target_logits.detach(), keep)
    return torch.where(keep, kl(log_p, log_probs(draft_logits, keep)), 0.0)


def adaspec_select(delta: Tensor, mask: Tensor, frac: float) -> Tensor:
    """Bool mask [...] of the ``ceil(frac · n)`` masked positions with the largest ``delta`` (n = masked count).

    AdaSPEC: ``delta = L_draft − L_ref`` per token; training on the tokens where the draft lags a reference distilled
    on everything skips the ones it cannot learn anyway. Ties are broken by position (the earliest first).
    """
    if not 0 < frac <= 1:
        raise ValueError(f"the selected fraction must be in (0, 1], got {frac}")
    keep = mask.bool()
    n = int(keep.sum())
    chosen = torch.zeros(keep.numel(), dtype=torch.bool, device=keep.device)
    if n > 0:
        scores = torch.where(keep, delta.detach().float(), -torch.inf).flatten()
        order = torch.sort(scores, descending=True, stable=True).indices[: min(n, math.ceil(frac * n - 1e-9))]
        chosen[order] = True
    return chosen.view(keep.shape)
