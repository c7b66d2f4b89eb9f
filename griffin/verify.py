"""Verifiers: which drafted tokens the target accepts, and the bonus token it emits after them.

A verifier turns the target's logits over a proposal (:class:`griffin.tree.Tree`, ``N + 1`` nodes; ``logits[i]``: the
target's next-token logits after node ``i``) into an :class:`Acceptance`, as tensor operations on the logits' device
(the cycle's one host sync comes after). The rules, and why each keeps the output exactly the target's, are in
docs/design.md#verification-rules: :class:`Greedy`, :class:`TreeSampling` (deterministic drafts) and the p/q chain rule
(:mod:`griffin.chain`, chosen by a draft LM's ``verifier`` method). A drafter without that method gets
:func:`default_verifier`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .sampling import SamplingConfig, greedy, sample, warp
from .tree import Tree


@dataclass
class Acceptance:
    path: torch.Tensor  # [D+1] node at each depth of the accepted path, root first; entries past `length`: padding
    length: torch.Tensor  # 0-dim long: a, the number of accepted drafted tokens (0..D)
    bonus: torch.Tensor  # [1] the target's token after the last accepted node

    def emitted(self, tree: Tree) -> torch.Tensor:
        """[D+1] the a accepted tokens, then the bonus, then padding (entries past a are not to be emitted)."""
        d = self.path.shape[0] - 1
        drafted = torch.cat((tree.tokens[self.path[1:]], self.bonus))  # [D+1]
        at_bonus = torch.arange(d + 1, device=drafted.device) == self.length
        return torch.where(at_bonus, self.bonus, drafted)


class Verifier(Protocol):
    def accept(self, tree: Tree, logits: torch.Tensor) -> Acceptance: ...


class Drafter(Protocol):
    """What the decode loop asks of a drafter (:mod:`griffin.drafters`; the cycle: ``docs/design.md``).

    - ``depth``, ``total_tokens``: every proposal has exactly ``total_tokens + 1`` nodes (root included; padded with
      :func:`griffin.tree.build_tree` / :func:`griffin.tree.chain`) and no node deeper than ``depth``;
    - ``start``: the prompt ids [P], the target's features of the prompt [P, H], the first new token [1];
    - ``propose``: a tree rooted at ``token`` (the newest token, not yet seen by the target), built with tensor
      operations only (the loop allows one host sync per cycle); a drafter that samples sets ``tree.q``;
    - ``accept``: tokens emitted since the last proposal [n] and the target's features of the positions that produced
      them [n, H] (after plain steps, all of theirs at once).

    Optional: ``verifier(sampling, generator) -> Verifier``, the rule its proposals need (default:
    :func:`default_verifier`), and ``resize(depth, total_tokens)``, a new tree shape from the next proposal on, which
    adaptation during a generation needs (:mod:`griffin.adapt`).
    """

    depth: int
    total_tokens: int

    def start(self, ids: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> None: ...

    def propose(self, token: torch.Tensor) -> Tree: ...

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None: ...


def follow(tree: Tree, choice: torch.Tensor) -> Acceptance:
    """The path the target takes through the tree when it emits ``choice[i]`` after node i ([N+1] token ids).

    From the root, move to the child whose token is the choice (the first in draft order if several are), as long as
    there is one; the bonus is the choice at the last node reached. Padding nodes are never entered.
    """
    n1 = tree.size
    nodes = torch.arange(n1, device=choice.device)
    match = (tree.parents[None, :] == nodes[:, None]) & (tree.tokens[None, :] == choice[:, None])  # [N+1, N+1]
    match[:, 0] = False  # the root is nobody's child
    if tree.valid is not None:
        match &= tree.valid[None, :]
    rank = tree.ranks()
    first = torch.where(match, rank[None, :], n1).argmin(dim=1)  # [N+1] chosen child of each node (if any)
    moved = match.any(dim=1)
    chosen = moved[tree.parents] & (first[tree.parents] == nodes)  # [N+1] the node is its parent's chosen child
    chosen[0] = True
    reached = ~(tree.ancestors & ~chosen[None, :]).any(dim=1)  # every node from the root down to it was chosen
    deepest = torch.where(reached, tree.depths, -1).argmax()  # the reached nodes form one chain
    length = tree.depths[deepest]
    on_path = tree.ancestors[deepest]  # [N+1]
    levels = torch.arange(tree.max_depth + 1, device=choice.device)
    at_level = on_path[None, :] & (tree.depths[None, :] == levels[:, None])  # [D+1, N+1]
    path = at_level.int().argmax(dim=1)  # levels past `length` have no node: 0 (padding)
    return Acceptance(path, length, choice[deepest].view(1))


class Greedy:
    """The longest path whose every token is the target's argmax after its parent; the argmax after it is the bonus."""

    def accept(self, tree: Tree, logits: torch.Tensor) -> Acceptance:
        return follow(tree, greedy(logits))


class TreeSampling:
    """The tree rule for deterministic drafts (docs/design.md#tree-sampling): exactly the target's distribution."""

    def __init__(self, cfg: SamplingConfig, generator: torch.Generator | None):
        self.cfg, self.generator = cfg, generator

    def accept(self, tree: Tree, logits: torch.Tensor) -> Acceptance:
        return follow(tree, sample(warp(logits, self.cfg), self.generator))


def default_verifier(sampling: SamplingConfig, generator: torch.Generator | None) -> Verifier:
    """Greedy at temperature 0, else the tree rule for deterministic drafts."""
    return Greedy() if sampling.greedy else TreeSampling(sampling, generator)
