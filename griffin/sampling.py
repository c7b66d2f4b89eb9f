"""The target's next-token distribution: warping as transformers does, and sampling on the device.

``warp`` applies temperature, then top-k, then top-p exactly as transformers' ``generate`` does, so sampling here has
the same distribution as ``generate(do_sample=True, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [.., V] -> probabilities [.., V] after temperature, top-k and top-p (transformers' order and ties)."""
    scores = logits.float() / cfg.temperature
    if cfg.top_k:
        kth = torch.topk(scores, min(cfg.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - cfg.top_p)
        remove[..., -1] = False  # always keep the most likely token
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return scores.softmax(dim=-1)


SAMPLE_BLOCK = 256  # tokens per block of the two-level inverse CDF


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token from each row of probs [.., V] (not necessarily normalised) -> [..], without a host sync.

    Two-level inverse-CDF sampling, each level with its own uniform u in (0, 1]: a block of ``SAMPLE_BLOCK`` tokens
    with probability proportional to its mass (the first block whose cumulative mass reaches u * total), then a token
    of that block the same way. A block's mass is a float32 sum of its probabilities (relative error ~1e-7, as the
    float32 softmax that made them); cumulative sums are float64, so no token's share drifts along the vocabulary, and
    a token of probability 0 is never drawn. Nothing of size V is copied. The uniforms come from ``generator``'s
    device: a seeded generator gives the same tokens on every run on that device.
    """
    exact = torch.float32 if probs.device.type == "mps" else torch.float64
    *lead, v = probs.shape
    pad = -v % SAMPLE_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(*lead, -1, SAMPLE_BLOCK)  # [.., V/B, B]
    device = generator.device if generator is not None else probs.device
    u = 1 - torch.rand((*lead, 2), dtype=exact, device=device, generator=generator)  # (0, 1]
    u = u.to(probs.device)
    mass = blocks.sum(dim=-1).to(exact).cumsum(dim=-1)  # [.., V/B]
    block = torch.searchsorted(mass, u[..., :1] * mass[..., -1:])  # [.., 1]
    inside = blocks.gather(-2, block[..., None].expand(*lead, 1, SAMPLE_BLOCK))[..., 0, :].to(exact).cumsum(dim=-1)
    token = torch.searchsorted(inside, u[..., 1:] * inside[..., -1:])  # [.., 1]
    return (block * SAMPLE_BLOCK + token)[..., 0]


def greedy(logits: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """The argmax of logits [.., V] over the vocabulary -> [..] (or [.., 1] with ``keepdim``): the first index among
    equal maxima, as ``argmax``, but through ``max``, whose CPU kernel is several times faster on bf16 rows of a large
    vocabulary (``benchmarks/results/greedy-pick.md``)."""
    return logits.max(dim=-1, keepdim=keepdim).indices


def sample_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """One token from logits [V] (the argmax when greedy) -> [1], on the logits' device."""
    if cfg.greedy:
        return greedy(logits, keepdim=True)
    return sample(warp(logits, cfg), generator).view(1)
