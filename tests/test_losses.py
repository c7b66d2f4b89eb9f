"""Token-level objectives: closed forms on hand-made distributions (with exact zeros), gradients against autograd of
the closed forms, and a toy fit that must raise the acceptance rate 1 − TVD. Each criterion is also applied to a
deliberately broken variant, which it must reject."""

from __future__ import annotations

import math

import pytest
import torch

from training import losses
from training.losses import NAMES, LinearSoftCrossEntropy, adaspec_select, kl, make_token_loss, per_token_fkl

# --- closed forms in float64 Python ------------------------------------------------------------------------------


def xlogy(a: float, b: float) -> float:
    return 0.0 if a == 0 else a * math.log(b)


CLOSED = {
    "soft-ce": lambda p, q: -sum(xlogy(a, b) for a, b in zip(p, q)),
    "fkl": lambda p, q: sum(xlogy(a, a) - xlogy(a, b) for a, b in zip(p, q)),
    "rkl": lambda p, q: sum(xlogy(b, b) - xlogy(b, a) for a, b in zip(p, q)),
    "jsd": lambda p, q, beta=0.5: sum(
        beta * (xlogy(a, a) - xlogy(a, beta * a + (1 - beta) * b))
        + (1 - beta) * (xlogy(b, b) - xlogy(b, beta * a + (1 - beta) * b)) for a, b in zip(p, q)),
    "tvd": lambda p, q: 0.5 * sum(abs(a - b) for a, b in zip(p, q)),
}


def tvdpp_closed(ps: list[list[float]], qs: list[list[float]]) -> list[float]:
    """Reward statistics over every (position, token) with p > 0 or q > 0."""
    pairs = [(a, b) for p, q in zip(ps, qs) for a, b in zip(p, q) if a > 0 or b > 0]
    rewards = [float(a > b) for a, b in pairs]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [-sum(b * (float(a > b) - mean) / std for a, b in zip(p, q) if a > 0 or b > 0) for p, q in zip(ps, qs)]


# Hand-made distributions over 5 tokens. Zeros: p only, q only, both (a reduced vocabulary), none.
P = [[0.5, 0.2, 0.2, 0.1, 0.0], [0.4, 0.3, 0.2, 0.1, 0.0], [0.7, 0.1, 0.1, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]]
Q = [[0.1, 0.2, 0.3, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25, 0.0], [0.6, 0.2, 0.2, 0.0, 0.0], [0.1, 0.4, 0.3, 0.15, 0.05]]
FINITE = {"soft-ce": [0, 1, 3], "fkl": [0, 1, 3], "rkl": [1, 2, 3], "jsd": [0, 1, 2, 3], "tvd": [0, 1, 2, 3],
          "tvdpp": [0, 1, 2, 3]}  # the rows where the divergence is finite


def logits_of(rows: list[list[float]]) -> torch.Tensor:
    """log-probabilities (with -inf for zeros) plus a per-row shift: logits, not normalised."""
    x = torch.tensor(rows, dtype=torch.float64).log()
    return (x + torch.arange(len(rows))[:, None]).float()


def matches_closed_form(loss, name: str) -> bool:
    rows = FINITE[name]
    ps, qs = [P[r] for r in rows], [Q[r] for r in rows]
    mask = torch.tensor([True] * len(rows) + [False])
    pad = [[1.0, 0, 0, 0, 0]]  # a padding row: q = 0 where p = 1, infinite unless the mask removes it
    qpad = [[0.0, 0, 0, 0, 1.0]]
    got = loss(logits_of(ps + pad), logits_of(qs + qpad), mask)
    want = tvdpp_closed(ps, qs) if name == "tvdpp" else [CLOSED[name](p, q) for p, q in zip(ps, qs)]
    return bool(torch.isfinite(got).all()) and torch.allclose(got, torch.tensor(want + [0.0]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_each_objective_matches_its_closed_form_with_exact_zeros(name):
    assert matches_closed_form(make_token_loss(name), name)


def per_position(loss):
    """Wrong normalisation for TVD++: reward statistics per position instead of over the batch."""
    return lambda t, d, m: torch.cat([loss(t[i : i + 1], d[i : i + 1], m[i : i + 1]) for i in range(len(m))])


def test_the_closed_form_check_rejects_wrong_normalisations():
    tvd = make_token_loss("tvd")
    assert not matches_closed_form(lambda t, d, m: 2 * tvd(t, d, m), "tvd")  # the ½ forgotten
    fkl = make_token_loss("fkl")

    def unnormalised(t, d, m):  # q from raw logits, not log-softmax
        return torch.where(m, kl(torch.log_softmax(t, -1), torch.where(m[:, None], d, 0)), 0)

    assert not matches_closed_form(unnormalised, "fkl")
    assert matches_closed_form(fkl, "fkl")
    assert not matches_closed_form(per_position(make_token_loss("tvdpp")), "tvdpp")
    assert not matches_closed_form(lambda t, d, m: -make_token_loss("rkl")(t, d, m), "rkl")  # sign


def test_infinite_only_where_the_divergence_is():
    p, q = logits_of([[0.5, 0.5, 0.0]]), logits_of([[1.0, 0.0, 0.0]])
    mask = torch.tensor([True])
    assert make_token_loss("fkl")(p, q, mask).item() == math.inf  # p > 0 = q: KL(p‖q) is infinite
    assert make_token_loss("rkl")(p, q, mask).item() == pytest.approx(math.log(2))


def test_temperature_scales_both_distributions():
    torch.manual_seed(0)
    t, d = torch.randn(3, 7), torch.randn(3, 7)
    mask = torch.ones(3, dtype=torch.bool)
    for name in NAMES:
        hot = make_token_loss(name, temperature=2.0)(t, d, mask)
        torch.testing.assert_close(hot, make_token_loss(name)(t / 2, d / 2, mask))


# --- gradients -----------------------------------------------------------------------------------------------------


def closed_torch(name: str, p: torch.Tensor, q: torch.Tensor, beta: float = 0.3) -> torch.Tensor:
    """Naive closed forms on strictly positive distributions (float64)."""
    if name == "fkl":
        return (p * (p.log() - q.log())).sum(-1)
    if name == "rkl":
        return (q * (q.log() - p.log())).sum(-1)
    if name == "soft-ce":
        return -(p * q.log()).sum(-1)
    if name == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)
    return 0.5 * (p - q).abs().sum(-1)


@pytest.mark.parametrize("name", ["soft-ce", "fkl", "rkl", "jsd", "tvd"])
def test_gradients_match_autograd_of_the_closed_form(name):
    torch.manual_seed(1)
    n, v = 6, 9
    t, d = torch.randn(n, v) * 2, torch.randn(n, v) * 2
    t[:, -2:] = d[:, -2:] = -torch.inf  # a reduced vocabulary: the last two tokens are not proposable
    mask = torch.tensor([True, True, False, True, True, True])
    d.requires_grad_(True)
    loss = make_token_loss(name, jsd_beta=0.3)
    loss(t, d, mask).sum().backward()
    ref = d.detach()[:, :-2].double().requires_grad_(True)
    p, q = torch.softmax(t[:, :-2].double(), -1), torch.softmax(ref, -1)
    (closed_torch(name, p, q) * mask).sum().backward()
    assert torch.isfinite(d.grad).all() and (d.grad[:, -2:] == 0).all() and (d.grad[2] == 0).all()
    torch.testing.assert_close(d.grad[:, :-2].double(), ref.grad, atol=1e-5, rtol=1e-4)


def test_soft_ce_has_the_gradient_of_forward_kl():
    torch.manual_seed(2)
    t, d = torch.randn(4, 11), torch.randn(4, 11, requires_grad=True)
    mask = torch.ones(4, dtype=torch.bool)
    g_ce, = torch.autograd.grad(make_token_loss("soft-ce")(t, d, mask).sum(), d)
    g_kl, = torch.autograd.grad(make_token_loss("fkl")(t, d, mask).sum(), d)
    torch.testing.assert_close(g_ce, g_kl)


@pytest.mark.parametrize("rows", [0, 1, 11])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_linear_soft_ce_in_chunks_equals_soft_ce_over_the_whole_logits(monkeypatch, rows, dtype):
    """The chunked soft-CE of a linear head (chunks of 4 rows here, the last one short) gives the loss, the top-k and
    the gradients of the composed form: ``(h Wᵀ).float()`` scored by the token loss, under autocast too."""
    monkeypatch.setattr(losses, "CHUNK_BITS", 6)  # 64 elements: 4 rows of 16
    torch.manual_seed(4)
    weight = torch.randn(16, 8, requires_grad=True)
    labels = torch.randn(13, 16) * 2
    index = torch.randint(0, 13, (rows,))
    hidden, g = torch.randn(rows, 8, requires_grad=True), torch.rand(rows)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss, top = LinearSoftCrossEntropy.apply(hidden, weight, labels.softmax(-1), index, 3)
        logits = torch.nn.functional.linear(hidden, weight).float()
    want = make_token_loss("soft-ce")(labels[index], logits, torch.ones(rows, dtype=torch.bool))
    tight = {"rtol": 1e-5, "atol": 1e-5} if dtype is None else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(loss, want, **tight)
    assert torch.equal(top, logits.topk(3, dim=-1).indices)
    if rows:
        got = torch.autograd.grad((loss * g).sum(), (hidden, weight), retain_graph=True)
        torch.testing.assert_close(got, torch.autograd.grad((want * g).sum(), (hidden, weight)), **tight)
        torch.testing.assert_close(torch.autograd.grad((loss * g).sum(), (hidden, weight)), got)  # logits kept
        assert got[0].dtype == hidden.dtype and got[1].dtype == weight.dtype


@pytest.mark.parametrize("name", NAMES)
def test_padding_rows_of_minus_inf_give_zero_and_finite_gradients(name):
    t = torch.full((3, 5), -torch.inf)
    d = torch.full((3, 5), -torch.inf)
    t[0], d[0] = torch.tensor([1.0, 2, 3, -torch.inf, 0]), torch.tensor([0.5, 2, 1, -torch.inf, 3])
    d.requires_grad_(True)
    out = make_token_loss(name)(t, d, torch.tensor([True, False, False]))
    out.sum().backward()
    assert out[1:].tolist() == [0.0, 0.0] and torch.isfinite(out).all()
    assert torch.isfinite(d.grad).all() and (d.grad[1:] == 0).all() and d.grad[0, 3] == 0


def test_tvdpp_reward_is_a_stop_gradient_policy_gradient():
    """∂/∂z of −Σ q·A with A constant is −q ⊙ (A − Σ q A): the softmax policy gradient."""
    torch.manual_seed(3)
    t, d = torch.randn(3, 6), torch.randn(3, 6, requires_grad=True)
    mask = torch.ones(3, dtype=torch.bool)
    make_token_loss("tvdpp")(t, d, mask).sum().backward()
    p, q = t.softmax(-1), d.detach().softmax(-1)
    r = (p > q).float()
    a = (r - r.mean()) / r.std(unbiased=False)
    torch.testing.assert_close(d.grad, -q * (a - (q * a).sum(-1, keepdim=True)), atol=1e-6, rtol=1e-5)


# --- the toy problem: a free logit vector fitted to a fixed p --------------------------------------------------------


def raises_acceptance(loss, seed: int = 0) -> bool:
    """Adam on free draft logits for 300 steps against a fixed target: TVD must fall below half its start."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(4, 12, generator=gen) * 2
    draft = torch.randn(4, 12, generator=gen).requires_grad_(True)
    mask = torch.ones(4, dtype=torch.bool)
    tvd = make_token_loss("tvd")
    start = tvd(target, draft, mask).mean().item()
    opt = torch.optim.Adam([draft], lr=0.05)
    for _ in range(300):
        opt.zero_grad()
        loss(target, draft, mask).sum().backward()
        opt.step()
    end = tvd(target, draft, mask).mean().item()
    return end < 0.5 * start


@pytest.mark.parametrize("name", NAMES)
def test_gradient_steps_raise_the_acceptance_rate(name):
    loss = make_token_loss(name)
    assert raises_acceptance(loss)
    assert not raises_acceptance(lambda t, d, m: -loss(t, d, m))  # the same criterion rejects a flipped sign


def test_unknown_names_and_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="unknown token loss"):
        make_token_loss("kl")
    with pytest.raises(ValueError, match="temperature"):
        make_token_loss("fkl", temperature=0)
    with pytest.raises(ValueError, match="β"):
        make_token_loss("jsd", jsd_beta=1.0)


# --- AdaSPEC -------------------------------------------------------------------------------------------------------


def test_per_token_fkl_is_the_fkl_objective():
    torch.manual_seed(4)
    t, d = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    mask = torch.tensor([[True, False, True], [True, True, False]])
    torch.testing.assert_close(per_token_fkl(t, d, mask), make_token_loss("fkl")(t, d, mask))
    assert (per_token_fkl(t, d) > 0).all()


def test_adaspec_keeps_the_top_fraction_of_masked_positions():
    delta = torch.tensor([[0.5, 9.0, -1.0, 3.0], [2.0, 7.0, 1.0, 8.0]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 0]])  # masked out: 9.0 and 8.0, the largest deltas
    got = adaspec_select(delta, mask, 0.4)  # 6 masked positions -> ceil(2.4) = 3 kept: 7.0, 3.0, 2.0
    assert got.tolist() == [[False, False, False, True], [True, True, False, False]]
    assert adaspec_select(delta, mask, 1.0).tolist() == mask.bool().tolist()
    assert not adaspec_select(delta, torch.zeros_like(mask), 0.4).any()
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        adaspec_select(delta, mask, 0.0)
