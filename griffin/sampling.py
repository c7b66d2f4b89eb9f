"""The target's next-token distribution and the acceptance rules that keep speculative decoding exact.

``warp`` applies temperature, then top-k, then top-p exactly as transformers' ``generate`` does, so sampling here has
the same distribution as ``generate(do_sample=True, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import Tree


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


def accept_greedy(tree: Tree, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The longest tree path whose every token is the target's argmax after its parent.

    logits [N+1, V] of the root and the N nodes -> (path: node indices from the root [a+1], bonus token [1]).
    """
    best = logits.argmax(dim=-1)  # [N+1] target's choice after each node
    correct = tree.tokens == best[tree.parents]  # [N+1]; the root's own entry is meaningless
    correct[0] = True
    fully = ~(tree.ancestors & ~correct[None, :]).any(dim=1)  # every node on the way from the root is correct
    deepest = torch.where(fully, tree.depths, -1).argmax()
    path = tree.ancestors[deepest].nonzero().squeeze(1)  # node ids ascend with depth
    return path, best[deepest].view(1)


def accept_sampling(tree: Tree, logits: torch.Tensor, cfg: SamplingConfig,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk the tree: at a node with target distribution p, try its children in draft order; accept child c with
    probability p(c), else zero p(c) and renormalise; when no child is accepted, sample the bonus from what is left.
    Draft tokens are deterministic proposals (q = delta), so the output has exactly the target's distribution."""
    probs = warp(logits, cfg).cpu()  # [N+1, V]
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children: list[list[int]] = [[] for _ in tokens]
    for node in tree.draft_order.tolist():  # best draft score first
        if node:
            children[parents[node]].append(node)
    node, path = 0, [0]
    while True:
        p = probs[node]
        for child in children[node]:
            token = tokens[child]
            if torch.rand((), generator=generator).item() * p.sum().item() < p[token].item():
                node = child
                path.append(child)
                break
            p = p.clone()
            p[token] = 0.0
        else:
            bonus = torch.multinomial(p / p.sum(), 1, generator=generator)
            return torch.tensor(path, device=tree.tokens.device), bonus.to(tree.tokens.device)


def sample_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """One token from logits [V] (argmax when greedy) -> [1]."""
    if cfg.greedy:
        return logits.argmax(dim=-1, keepdim=True)
    probs = warp(logits, cfg).cpu()
    return torch.multinomial(probs, 1, generator=generator).to(logits.device)
