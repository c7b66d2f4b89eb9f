"""The p/q chain rule of classic speculative sampling: hand-built cases, greedy as its special case, and a chi-square
test on an enumerable bigram target that passes for the rule and rejects planted bugs."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

import griffin.chain as chain
from griffin.chain import chain_accept, chain_accept_greedy, sample_from


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_equal_distributions_accept_everything_and_the_bonus_comes_from_the_last_row():
    q = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.4, 0.0]])
    p = torch.cat((q, torch.tensor([[0.0, 0.0, 1.0]])))
    for seed in range(50):
        n, nxt = chain_accept(torch.tensor([2, 1]), q, p, seeded(seed))
        assert int(n) == 2 and nxt.tolist() == [2]


def test_a_token_the_target_cannot_produce_is_always_rejected_and_resampled_from_the_residual():
    q = torch.tensor([[0.0, 0.2, 0.8], [1.0, 0.0, 0.0]])
    p = torch.tensor([[0.5, 0.5, 0.0], [0.3, 0.3, 0.4], [1.0, 0.0, 0.0]])
    seen = torch.zeros(3)
    for seed in range(2000):
        n, nxt = chain_accept(torch.tensor([2, 0]), q, p, seeded(seed))
        assert int(n) == 0
        seen[nxt] += 1
    # residual max(0, p - q) = [0.5, 0.3, 0] -> 5/8, 3/8, never the rejected token
    assert seen[2] == 0 and abs(seen[0] / 2000 - 0.625) < 0.04


def test_acceptance_probability_is_p_over_q_and_q_zero_outside_a_reduced_vocabulary_is_exact():
    # q is 0 on tokens 2 and 3 (outside the draft vocabulary); p puts mass there
    q = torch.tensor([[0.8, 0.2, 0.0, 0.0]])
    p = torch.tensor([[0.2, 0.1, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    runs, accepted, seen = 5000, 0, torch.zeros(4)
    for seed in range(runs):
        n, nxt = chain_accept(torch.tensor([0]), q, p, seeded(seed))
        accepted += int(n)
        if int(n) == 0:
            seen[nxt] += 1
    assert abs(accepted / runs - 0.25) < 0.02  # min(1, 0.2 / 0.8)
    # residual max(0, p - q) = [0, 0, 0.3, 0.4]: token 1 (p < q) and token 0 never come back
    assert seen[0] == 0 and seen[1] == 0 and abs(seen[2] / seen.sum() - 3 / 7) < 0.03


def test_sample_from_never_returns_a_zero_weight_token():
    weights = torch.tensor([0.0, 0.0, 3.0, 0.0, 1.0, 0.0])
    for u in (0.0, 1e-12, 0.74, 0.75, 0.999999, 1 - 2**-24):
        assert sample_from(weights, torch.tensor(u)).item() in (2, 4)
    assert sample_from(weights, torch.tensor(0.5)).item() == 2 and sample_from(weights, torch.tensor(0.8)).item() == 4


def test_greedy_is_the_special_case_of_one_hot_distributions():
    torch.manual_seed(0)
    vocab = 6
    for gamma, seed in itertools.product((1, 3, 5), range(30)):
        logits = torch.randn(gamma + 1, vocab, generator=seeded(seed))
        best = logits.argmax(-1)
        tokens = torch.where(torch.rand(gamma, generator=seeded(seed + 1)) < 0.7, best[:gamma],
                             torch.randint(0, vocab, (gamma,), generator=seeded(seed + 2)))
        one_hot_p = torch.nn.functional.one_hot(best, vocab).float()
        one_hot_q = torch.nn.functional.one_hot(tokens, vocab).float()
        n_g, next_g = chain_accept_greedy(tokens, logits)
        n_s, next_s = chain_accept(tokens, one_hot_q, one_hot_p, seeded(seed))
        assert int(n_g) == int(n_s) and next_g.tolist() == next_s.tolist()
        n = int(n_g)
        assert torch.equal(tokens[:n], best[:n]) and (n == gamma or tokens[n] != best[n])
        assert next_g.item() == best[n].item()


# --- chi-square on an enumerable target ------------------------------------------------------------------------------

VOCAB, LENGTH, GAMMA, START = 4, 3, 2, 0


def bigram_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Target P[a] and draft Q[a]: next-token distributions after token a. The draft never proposes token 3."""
    gen = seeded(7)
    target = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 1.2, dim=-1)
    draft_logits = torch.randn(VOCAB, VOCAB, generator=gen) * 1.2
    draft_logits[:, 3] = -torch.inf
    return target, torch.softmax(draft_logits, dim=-1)


def speculative_sequence(target: torch.Tensor, draft: torch.Tensor, gen: torch.Generator) -> tuple:
    """LENGTH tokens after START, drafted GAMMA at a time from the draft table and verified by the chain rule."""
    seq = [START]
    while len(seq) <= LENGTH:
        tokens, last = [], seq[-1]
        for _ in range(GAMMA):
            last = int(sample_from(draft[last], torch.rand((), generator=gen)))
            tokens.append(last)
        tokens_t = torch.tensor(tokens)
        p = target[torch.tensor([seq[-1]] + tokens)]  # [γ+1, V]: the target's distribution at each drafted position
        q = draft[torch.tensor([seq[-1]] + tokens[:-1])]  # [γ, V]
        n, nxt = chain_accept(tokens_t, q, p, gen)
        seq += tokens[: int(n)] + nxt.tolist()
    return tuple(seq[1 : LENGTH + 1])


def chi_square_pvalue(runs: int = 4000) -> float:
    target, draft = bigram_tables()
    exact = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        prob, last = 1.0, START
        for tok in seq:
            prob *= float(target[last, tok])
            last = tok
        exact[seq] = prob
    gen = seeded(123)
    counts: dict[tuple, int] = {}
    for _ in range(runs):
        key = speculative_sequence(target, draft, gen)
        counts[key] = counts.get(key, 0) + 1
    observed = [counts.get(s, 0) for s in exact]
    expected = [exact[s] * runs for s in exact]
    return chisquare(observed, expected).pvalue


def test_chi_square_the_chain_rule_samples_the_target_distribution():
    assert chi_square_pvalue() > 0.001


@pytest.mark.parametrize("planted", [lambda p, q: p - q, lambda p, q: p], ids=["no-max-0", "resample-from-p"])
def test_chi_square_rejects_a_wrong_residual(monkeypatch, planted):
    monkeypatch.setattr(chain, "residual", planted)
    assert chi_square_pvalue() < 1e-6
