"""Classic speculative sampling (Leviathan et al.): the acceptance rule of a drafted chain.

The rule and why it is exact: docs/design.md#chain-pq-rule.

A draft LM sampled ``y_1..y_γ`` from its distributions ``q_1..q_γ``; one target forward gave ``p_1..p_{γ+1}`` (``p_i``
is the target's distribution where ``y_i`` is drafted). Accept ``y_i`` with probability ``min(1, p_i(y_i)/q_i(y_i))``;
at the first rejection emit a token from ``norm(max(0, p_i − q_i))`` and stop; if all are accepted, emit a bonus token
from ``p_{γ+1}``. Every emitted token then has exactly the target's distribution, whatever q is: a q with zeros outside
a reduced draft vocabulary is exact too (the residual keeps all of p's mass there).

Greedy decoding is the special case of one-hot p and q (argmax): a drafted token is accepted iff it is the target's
argmax, and the token after the last accepted one is the target's argmax there. Temperature, top-k and top-p are
applied to both p and q by :func:`griffin.sampling.warp` before this rule.

Everything stays on the logits' device; the only host sync is the caller's reading of the accepted count.
"""

from __future__ import annotations

import torch

from .sampling import SamplingConfig, greedy, warp
from .tree import Tree
from .verify import Acceptance

Tensor = torch.Tensor


def residual(p: Tensor, q: Tensor) -> Tensor:
    """The unnormalised distribution to resample from after a rejection: ``max(0, p − q)`` [.., V]."""
    return (p - q).clamp(min=0)


def uniform(n: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """n uniforms in [0, 1) drawn from ``generator`` (on its own device), on ``device``."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(n, generator=generator, device=gen_device).to(device, non_blocking=True)


def sample_from(weights: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling of one token from non-negative ``weights`` [V] (any scale) with a uniform ``u`` [] -> [1].

    A token of weight 0 is never returned."""
    cdf = weights.double().cumsum(-1)
    total = cdf[-1:]
    x = torch.minimum(u.double() * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).clamp(max=weights.shape[-1] - 1)


def chain_accept(tokens: Tensor, q: Tensor, p: Tensor, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """tokens [γ] drafted from q [γ, V]; target p [γ+1, V] (both already warped) -> (accepted count [], next [1]).

    The next token is the resample after the first rejection, or the bonus from ``p[γ]`` when all γ are accepted.
    """
    gamma = tokens.shape[0]
    u = uniform(gamma + 1, generator, p.device)
    rows = torch.arange(gamma, device=p.device)
    py, qy = p[rows, tokens], q[rows, tokens]
    accepted = (u[:gamma] * qy < py).int().cumprod(0).sum()  # u < p/q without dividing (q(y) > 0: y was drafted)
    q = torch.cat((q, torch.zeros_like(q[:1])))  # [γ+1, V]: after γ acceptances the residual is p_{γ+1} itself
    return accepted, sample_from(residual(p[accepted], q[accepted]), u[gamma])


def chain_accept_greedy(tokens: Tensor, p_logits: Tensor) -> tuple[Tensor, Tensor]:
    """tokens [γ], target logits [γ+1, V] -> (accepted count [], next [1]): the longest prefix that is the target's
    argmax, then the target's argmax after it."""
    best = greedy(p_logits)  # [γ+1]
    accepted = (tokens == best[:-1]).int().cumprod(0).sum()
    return accepted, best[accepted].view(1)


class ChainVerifier:
    """The verifier of chain proposals from a draft LM (:class:`griffin.drafters.DraftLMDrafter`): the p/q chain rule
    on the target's warped logits and ``tree.q`` (greedy: the argmax rule, no q needed)."""

    def __init__(self, cfg: SamplingConfig, generator: torch.Generator | None):
        self.cfg, self.generator = cfg, generator

    def accept(self, tree: Tree, logits: Tensor) -> Acceptance:
        """tree: root and γ drafted tokens, ``tree.q`` [γ+1, V] (row γ unused); logits [γ+1, V]."""
        tokens = tree.tokens[1:]
        if self.cfg.greedy:
            length, bonus = chain_accept_greedy(tokens, logits)
        else:
            length, bonus = chain_accept(tokens, tree.q[:-1], warp(logits, self.cfg), self.generator)
        return Acceptance(torch.arange(tree.size, device=logits.device), length, bonus)
