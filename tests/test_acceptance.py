"""Acceptance on hand-built trees with exact probabilities: greedy paths, and sampling's output distribution.

Node ids of the tree below (``build_tree`` numbers candidates in level order; a parent precedes its children)::

    root(7) ── 1:tok 1 ── 3:tok 3 ── 6:tok 6
            │          └─ 4:tok 4
            └─ 2:tok 2 ── 5:tok 5
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from griffin.sampling import SamplingConfig, greedy, warp
from griffin.tree import Tree, build_tree
from griffin.verify import Greedy, TreeSampling


def accept_greedy(tree: Tree, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's greedy verifier -> (accepted path from the root, bonus [1])."""
    acceptance = Greedy().accept(tree, logits)
    return acceptance.path[: int(acceptance.length) + 1], acceptance.bonus


def accept_sampling(tree: Tree, logits: torch.Tensor, cfg: SamplingConfig,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's tree-sampling verifier -> (accepted path from the root, bonus [1])."""
    acceptance = TreeSampling(cfg, generator).accept(tree, logits)
    return acceptance.path[: int(acceptance.length) + 1], acceptance.bonus


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_takes_the_first_of_tied_maxima_like_argmax(dtype):
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randint(0, 3, (4, 2000), generator=g).to(dtype)  # many ties at the maximum in every row
        assert torch.equal(greedy(logits), logits.argmax(dim=-1))
        assert torch.equal(greedy(logits[0], keepdim=True), logits[0].argmax(dim=-1, keepdim=True))
    logits = torch.zeros(3, 50, dtype=dtype)
    logits[:, [7, 30]] = 1.0
    assert greedy(logits).tolist() == [7, 7, 7]


VOCAB = 10
CHILDREN = {0: [1, 2], 1: [3, 4], 2: [5], 3: [6], 4: [], 5: [], 6: []}  # node -> children in draft order
TOKEN = {0: 7, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}  # node -> token


def hand_tree():
    tree = build_tree(torch.tensor([7]), tokens=torch.tensor([1, 2, 3, 4, 5, 6]),
                      scores=torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]),
                      parents=torch.tensor([-1, -1, 0, 0, 1, 2]), levels=torch.tensor([1, 1, 2, 2, 2, 3]),
                      total_tokens=6)
    assert tree.tokens.tolist() == [7, 1, 2, 3, 4, 5, 6] and tree.parents.tolist() == [0, 0, 0, 1, 1, 2, 3]
    return tree


def argmax_logits(choice: dict[int, int]) -> torch.Tensor:
    """[7, V] logits whose argmax after node i is ``choice[i]``."""
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(0))
    for node, token in choice.items():
        logits[node, token] = 10.0
    return logits


@pytest.mark.parametrize("choice,path,bonus", [
    ({0: 2, 2: 5, 5: 9}, [0, 2, 5], 9),  # through the second-ranked child of the root
    ({0: 1, 1: 4, 4: 8, 3: 6}, [0, 1, 4], 8),  # node 3's child is right, but node 3 itself was not
    ({0: 9, 1: 3, 3: 6}, [0], 9),  # nothing accepted: the root's argmax is the bonus
    ({0: 1, 1: 3, 3: 6, 6: 0}, [0, 1, 3, 6], 0),  # the whole deepest branch, then the bonus after its leaf
    ({0: 1, 1: 3, 3: 5}, [0, 1, 3], 5),  # 5 is a node's token elsewhere in the tree, not a child of node 3
])
def test_greedy_accepts_the_longest_path_of_target_argmaxes(choice, path, bonus):
    got_path, got_bonus = accept_greedy(hand_tree(), argmax_logits(choice))
    assert got_path.tolist() == path and got_bonus.tolist() == [bonus]


def exact_outcomes(probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """What one cycle must emit with target distributions ``probs`` [7, V] (one per node): the tokens of a tree path,
    then one token that is not a child of the path's last node. P = the product of the target's probabilities."""
    out: dict[tuple[int, ...], float] = {}

    def walk(node: int, emitted: tuple[int, ...], p: float) -> None:
        child_tokens = {TOKEN[c]: c for c in CHILDREN[node]}
        for token in range(VOCAB):
            q = p * float(probs[node, token])
            if q == 0:
                continue
            if token in child_tokens:
                walk(child_tokens[token], emitted + (token,), q)
            else:
                out[emitted + (token,)] = q

    walk(0, (), 1.0)
    return out


def sampled_outcomes(logits: torch.Tensor, cfg: SamplingConfig, runs: int) -> dict[tuple[int, ...], int]:
    tree, generator = hand_tree(), torch.Generator().manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(runs):
        path, bonus = accept_sampling(tree, logits, cfg, generator)
        assert path[0] == 0 and all(int(c) in CHILDREN[int(p)] for p, c in zip(path[:-1], path[1:]))
        key = tuple(tree.tokens[path[1:]].tolist()) + tuple(bonus.tolist())
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_sampling_with_degenerate_distributions_is_deterministic():
    probs = torch.zeros(7, VOCAB)
    probs[0, 2], probs[2, 5], probs[5, 9] = 1.0, 1.0, 1.0  # certain: the second child, its child, then 9
    probs[1:, 0] = 1.0  # the other nodes (never reached) would emit 0
    probs[2, 0] = probs[5, 0] = 0.0
    counts = sampled_outcomes(torch.log(probs), SamplingConfig(temperature=1.0), runs=50)
    assert counts == {(2, 5, 9): 50}
    probs = torch.full((7, VOCAB), 1.0 / (VOCAB - 2))
    probs[0, 1] = probs[0, 2] = 0.0  # the root's children have probability 0: never accepted, never the bonus
    counts = sampled_outcomes(torch.log(probs), SamplingConfig(temperature=1.0), runs=200)
    assert all(len(key) == 1 and key[0] not in (1, 2) for key in counts)


CASES = {"plain": SamplingConfig(temperature=1.0), "T=0.7, top-k 4": SamplingConfig(temperature=0.7, top_k=4),
         "T=1.3, top-p 0.8": SamplingConfig(temperature=1.3, top_p=0.8)}


def transformers_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The next-token distribution of transformers' generate(do_sample=True) with these settings."""
    warpers = [TemperatureLogitsWarper(cfg.temperature)]
    if cfg.top_k:
        warpers.append(TopKLogitsWarper(cfg.top_k))
    if cfg.top_p < 1:
        warpers.append(TopPLogitsWarper(cfg.top_p))
    scores = logits.clone()
    for w in warpers:
        scores = w(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize("case", CASES)
def test_sampling_emits_exactly_the_target_distribution(case):
    """Every outcome's frequency over 4000 seeded cycles is within 4.5 standard errors of its exact probability."""
    cfg = CASES[case]
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(7)) * 1.5
    logits[0, 1] += 2.0  # drafts the target likes: long paths are common
    logits[1, 3] += 2.0
    logits[3, 6] += 1.5
    probs = transformers_probs(logits, cfg)
    torch.testing.assert_close(warp(logits, cfg), probs, rtol=1e-6, atol=1e-7)
    exact = exact_outcomes(probs.double())
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-6)
    runs = 4000
    counts = sampled_outcomes(logits, cfg, runs)
    assert set(counts) <= set(exact), "an outcome the target cannot produce"
    # outcomes expected fewer than 5 times are pooled: the normal bound does not hold for them one by one
    rare = [key for key, p in exact.items() if p * runs < 5]
    cells = [([key], exact[key]) for key in exact if key not in rare] + [(rare, sum(exact[k] for k in rare))]
    for keys, p in cells:
        frequency = sum(counts.get(key, 0) for key in keys) / runs
        assert abs(frequency - p) <= 4.5 * math.sqrt(p * (1 - p) / runs) + 1e-9, (keys, frequency, p)
    assert sum(n for key, n in counts.items() if len(key) >= 3) > runs // 10  # deep paths really were accepted


def test_exact_outcomes_of_the_hand_built_tree():
    """The enumeration the sampling test relies on: P(path then bonus) multiplies the target's probabilities."""
    probs = torch.full((7, VOCAB), 0.1, dtype=torch.float64)
    exact = exact_outcomes(probs)
    assert exact[(9,)] == pytest.approx(0.1)
    assert exact[(1, 3, 6, 0)] == pytest.approx(0.1**4)
    assert exact[(2, 5, 5)] == pytest.approx(0.1**3)
    assert (1, 3) not in exact and (2, 5) not in exact  # a path alone is never an outcome: a bonus always follows
    assert len(exact) == sum(VOCAB - len(c) for c in CHILDREN.values())
    assert max(len(key) for key in exact) == 4  # the deepest branch (3 nodes) and its bonus
