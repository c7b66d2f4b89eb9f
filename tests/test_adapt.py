"""Adaptation during a generation: shapes switched mid-generation (no tree included) keep the target's output."""

from __future__ import annotations

import math

import pytest
import torch

from griffin import SpecGenerator, autotune
from griffin.adapt import ADAPT_RATIO, ADAPT_ROWS, PLAIN, Shape, ShapePolicy, needed_ratio, probe_excess
from griffin.autotune import cost_scale, pass_cost, shapes
from griffin.decode import GenerationStats, decode
from griffin.drafters import head_drafter
from griffin.io import write_cached
from griffin.kv_cache import BufferCache
from griffin.sampling import SamplingConfig
from tests.conftest import pooled_chisquare, tiny_model
from tests.test_engine import counted, syncs_per_cycle  # noqa: F401, F811 - counted is a fixture
from tests.test_generation import NoTokenizer, exact_sequences, untrained_head

BIG, SMALL = Shape(3, 10, 2.0, 1.5), Shape(1, 2, 1.3, 1.1)


class Scripted:
    """A policy that takes the shapes of ``script`` in turn, one per cycle, whatever the cycles accept."""

    plain_first = False  # as where the tuner kept a tree: every probe runs

    def __init__(self, script: list[Shape], start: int = 0):
        self.script, self.turn = script, start
        self.seen: list[tuple[str, int]] = []

    def shape(self) -> Shape:
        return self.script[self.turn % len(self.script)]

    def observe(self, shape: Shape, emitted: int) -> None:
        self.seen.append((shape.name, emitted))
        self.turn += 1


def run(gen: SpecGenerator, prompt: torch.Tensor, budget: int, policy, sampling: SamplingConfig | None = None,
        seed: int = 0, lookup: int = 0) -> tuple[list[int], GenerationStats]:
    sampling = sampling or SamplingConfig()
    capacity = prompt.shape[0] + budget
    drafter = head_drafter(gen.draft, BIG.depth, gen.top_k, BIG.total_tokens, capacity, lookup)
    cache = BufferCache(gen.num_layers, capacity + drafter.total_tokens + 1)
    generator = None if sampling.greedy else torch.Generator().manual_seed(seed)
    stats = GenerationStats()
    chunks = decode(gen.backend, drafter, prompt, budget, sampling, gen.eos_ids([]), generator, stats, cache,
                    policy=policy)
    return torch.cat(list(chunks)).tolist(), stats


@pytest.mark.parametrize("lookup", [0, 4])
def test_switching_shapes_mid_generation_down_to_no_tree_and_back_keeps_greedy_output(lookup):
    """Greedy output equals generate's whatever the shapes; with a lookup chain over text that repeats, paths of
    several tokens are accepted on both sides of the plain stretches."""
    target = tiny_model("llama", vocab_size=96, seed=2)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), top_k=4)
    script = [BIG, PLAIN, PLAIN, SMALL, BIG, PLAIN, SMALL, SMALL, PLAIN]
    accepted = 0
    for seed in range(3):
        prompt = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(seed))
        ref = target.generate(prompt[None], max_new_tokens=40, do_sample=False)[0, 7:].tolist()
        prompt = torch.cat((prompt, torch.tensor(ref[:20]), prompt, torch.tensor(ref[:20]))) if lookup else prompt
        ref = target.generate(prompt[None], max_new_tokens=40, do_sample=False)[0, prompt.shape[0]:].tolist()
        policy = Scripted(script, start=seed)
        out, stats = run(gen, prompt, 40, policy, lookup=lookup)
        assert out == ref
        names = [name for name, _ in policy.seen]
        assert {"plain", BIG.name, SMALL.name} <= set(names)
        assert any(a == "plain" and b != "plain" for a, b in zip(names, names[1:]))  # back up from no tree
        assert stats.plain_steps - names.count("plain") in (0, 1)  # the last cycle is not observed
        assert stats.shapes[BIG.name] >= 2
        accepted += sum(count - 1 for name, count in policy.seen if name != "plain")
    assert accepted > (30 if lookup else -1)


def test_sampling_holds_while_shapes_switch():
    """Cycles alternate between two trees and plain steps (in three orders); the first four tokens keep the target's
    distribution under temperature 0.8 and top-k 3 (chi-square against the exact one)."""
    target = tiny_model("llama", vocab_size=5, hidden=16, layers=1, seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # a spread-out distribution
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target, "eagle"), top_k=2)
    prompt = torch.tensor([1, 3, 0])
    cfg = SamplingConfig(temperature=0.8, top_k=3)
    exact = exact_sequences(target, prompt, cfg, length=4)
    counts: dict[tuple, int] = {}
    runs, plain, drafted = 1500, 0, 0
    for seed in range(runs):
        out, stats = run(gen, prompt, 4, Scripted([Shape(1, 2, 1.5, 1.2), PLAIN, Shape(2, 3, 1.8, 1.4)], seed), cfg,
                         seed)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        plain += stats.plain_steps
        drafted += stats.new_tokens - 1 - stats.cycles  # drafted tokens accepted
    assert set(counts) <= set(exact), "sampled a sequence the target cannot produce under top-k 3"
    assert plain > runs // 2 and drafted > runs // 4
    pvalue, cells = pooled_chisquare(counts, exact, runs)
    assert cells > 20 and pvalue > 0.001, (pvalue, counts)


def test_the_policy_drops_to_plain_decoding_probes_with_backoff_and_comes_back():
    policy = ShapePolicy([BIG, SMALL])
    assert policy.shape() is BIG  # the tuner's estimate pays: start on the best tree
    trees = []
    while policy.shape() is not PLAIN:  # nothing accepted: the smaller tree, then no tree
        trees.append(policy.shape())
        policy.observe(policy.shape(), 1)
    assert trees[0] is BIG and SMALL in trees and len(trees) <= 20
    waits = []
    for _ in range(4):  # every probe fails: the waits between them double
        plain = 0
        while policy.shape() is PLAIN:
            policy.observe(PLAIN, 1)
            plain += 1
        waits.append(plain)
        policy.observe(policy.shape(), 1)
    assert waits == [4, 8, 16, 32]
    probes = 0
    while policy.shape() is not BIG and probes < 3:  # the request starts quoting its context: probes accept all
        while policy.shape() is PLAIN:
            policy.observe(PLAIN, 1)
        probes += 1
        policy.observe(policy.shape(), policy.shape().depth + 1)
    assert policy.shape() is BIG and policy.wait == 4 and probes <= 3
    losing = Shape(2, 4, 1.5, 1.8)  # a tree the tuner expects to lose (rate 0.83)
    first = ShapePolicy([losing], plain_first=True)  # the tuner measured no tree paying: one probe, then waits longest
    assert first.shape() is losing
    first.observe(losing, 1)
    assert first.shape() is PLAIN and first.wait == 32
    quoting = ShapePolicy([losing], plain_first=True)  # the request accepts what the tuner's requests did not
    quoting.observe(losing, 3)
    assert quoting.shape() is losing and quoting.ratio == 2.5
    for _ in range(2):  # then accepts nothing: the one good cycle is not trusted for long
        quoting.observe(losing, 1)
    assert quoting.shape() is PLAIN


def test_where_the_tuner_kept_no_tree_a_probe_runs_only_where_the_context_repeats_its_last_ngram():
    """As in a batch: on the CPU (trimmed chains), with a policy that starts plain, a probe that would find no chain
    to copy is a plain step instead, the plain steps' tokens counted before the drafter reads them; the output is
    still generate's."""
    target = tiny_model("llama", vocab_size=96, seed=3)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), top_k=4)
    held = ran = 0
    for seed in range(3):
        prompt = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(seed))
        ref = target.generate(prompt[None], max_new_tokens=40, do_sample=False)[0, 9:].tolist()
        drafter = head_drafter(gen.draft, 2, 4, 4, 9 + 40, 3, trim=True)
        policy = ShapePolicy([Shape(2, 4, 1.5, 1.8)], plain_first=True, max_probe=2)  # a probe every other step
        answers: list[bool] = []
        promising, propose = drafter.promising, drafter.propose

        def spy_promising(pending, answers=answers, promising=promising):
            answers.append(promising(pending))
            return answers[-1]

        def spy_propose(token, policy=policy, answers=answers, propose=propose, drafter=drafter):
            if policy.probing:
                assert answers[-1] and drafter.context.lookup(1, drafter.ngrams)[1][0]
            return propose(token)

        drafter.promising, drafter.propose = spy_promising, spy_propose
        cache = BufferCache(gen.num_layers, 9 + 40 + drafter.total_tokens + 1)
        out = decode(gen.backend, drafter, prompt, 40, SamplingConfig(), gen.eos_ids([]), None, GenerationStats(),
                     cache, policy=policy)
        assert torch.cat(list(out)).tolist() == ref
        held, ran = held + answers.count(False), ran + answers.count(True)
    assert held > 0 and ran > 0  # some probes waited for a repeat, some ran
    lookup = head_drafter(gen.draft, 2, 4, 4, 16, 3, trim=True)
    lookup.context.reset(torch.tensor([1, 2, 3, 1, 2]))
    assert lookup.promising(torch.tensor([], dtype=torch.long))  # its last 2-gram repeats
    assert lookup.promising(torch.tensor([3]))  # its last 3-gram repeats
    assert not lookup.promising(torch.tensor([9]))  # 2, 9 occurs nowhere before
    static = head_drafter(gen.draft, 2, 4, 4, 16, 3)  # static chains: no reading, no gate
    static.context.reset(torch.tensor([1, 2, 3]))
    assert static.promising(torch.tensor([9]))


def test_where_the_tuner_kept_no_tree_a_request_adapts_only_if_twice_its_acceptance_would_pay():
    """A request that accepts ADAPT_RATIO times what the tuner expects must be able to make the best tree pay: the
    EPYC's shapes in bf16 (a cycle of 1 node costing 2.34 plain steps for 1.625 tokens) need 2.15x and run the plain
    loop; in fp32 (1.44 steps for 1.44 tokens) they need 1.0x and adapt. A kept tree adapts whatever it needs."""
    target = tiny_model("llama", vocab_size=96, seed=3)
    bf16, fp32 = [Shape(1, 1, 1.625, 2.34), Shape(2, 4, 2.125, 3.5)], [Shape(1, 1, 1.44, 1.44)]
    assert needed_ratio(bf16) == pytest.approx(1.34 / 0.625) and needed_ratio(fp32) == pytest.approx(1.0)
    assert needed_ratio(bf16) > ADAPT_RATIO >= needed_ratio(fp32)
    plain = SpecGenerator(target, NoTokenizer(), untrained_head(target), top_k=4, total_tokens=0)
    assert plain.plain
    prompt = torch.arange(3, 12)
    for found, adapts in ((bf16, False), (fp32, True)):
        plain._shapes = found
        assert plain.adapting is adapts
        out = plain.generate(prompt, max_new_tokens=24)
        assert bool(out.stats.shapes) is adapts  # the costly shapes never draft: the plain loop throughout
    kept = SpecGenerator(target, NoTokenizer(), untrained_head(target), top_k=4, total_tokens=10)
    kept._shapes = bf16
    assert kept.adapting


def test_a_batch_decides_on_its_slowest_row():
    """A batch takes as many cycles as its slowest row: one row accepting the whole tree while the other accepts
    nothing does not keep the tree, where both accepting it does."""
    split, both = ShapePolicy([BIG]), ShapePolicy([BIG])
    for _ in range(3):
        split.observe(BIG, {0: BIG.depth + 1, 1: 1})
        both.observe(BIG, {0: BIG.depth + 1, 1: BIG.depth + 1})
    assert split.shape() is PLAIN and both.shape() is BIG
    assert split.ratio < 1 < both.ratio
    split.observe(PLAIN, 1)
    assert split.seen.keys() == {0, 1}  # plain steps leave the rows' ratios as they were
    for _ in range(3):  # row 1 has finished; row 0 alone accepting all brings the tree back once probed
        while split.shape() is PLAIN:
            split.observe(PLAIN, 1)
        split.observe(BIG, {0: BIG.depth + 1})
    assert split.shape() is BIG


def test_a_batch_prices_the_lookup_nodes_it_verifies_on_the_forward_cost_curve():
    """A tree the tuner priced at 3 nodes per row that verifies 12 (a row's lookup chain widens every row) costs what
    the curve says 12 nodes cost; the wait before a probe is multiplied by what a losing probe costs beyond a plain
    step. Without a curve the tuner's cost stands."""
    curve = {1: 1.0, 2: 1.1, 3: 1.2, 5: 1.6, 9: 2.4}  # plain steps by nodes per row; past 9: 0.2 per node
    tree = Shape(1, 1, 1.5, 1.25, 11, 3.0)  # 1 head node, a chain of 1 expected: a rate of 1.2 as tuned
    assert tree.chain == 1
    priced, unpriced = ShapePolicy([tree], curve=curve), ShapePolicy([tree])
    assert priced.cost(tree) == unpriced.cost(tree) == 1.25 and priced.rate(tree) == pytest.approx(1.2)
    for policy in (priced, unpriced):
        policy.observe(tree, 2, width=12)  # accepted as expected, through a chain of 10
    assert unpriced.cost(tree) == 1.25 and unpriced.shape() is tree
    chain = (1 + 10) / 2  # the prior's chain and the observed one
    assert priced.cost(tree) == pytest.approx(1.25 + (1.6 + 0.2 * (2 + chain - 5)) - 1.2)
    assert priced.shape() is PLAIN
    for _ in range(3):
        priced.observe(tree, 2, width=12)
    steps = 0
    while priced.shape() is PLAIN:
        priced.observe(PLAIN, 1)
        steps += 1
    assert priced.cost(tree) > 2 and steps == math.ceil(priced.wait * (priced.cost(tree) - 1)) > priced.wait


def test_batches_adapt_on_one_tree_where_none_was_kept_and_a_probe_loses_at_most_a_plain_step(tmp_path, monkeypatch):
    """A batch of at most ADAPT_ROWS adapts between plain steps and one tree only where its size's record kept none:
    the record's best estimate, while a probe at a full lookup chain costs at most PROBE_EXCESS plain steps beyond its
    tokens. A kept tree stays fixed."""
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    target = tiny_model("qwen2", vocab_size=80, seed=4)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=3, top_k=4, total_tokens=10, lookup=8)
    gen.autotuned = True
    candidates = [{"depth": d, "total_tokens": n, "tau": 1.4 + 0.05 * n, "speedup": 1.0 - 0.02 * n, "nodes": n + 2.0}
                  for d in (1, 2) for n in (1, 2, 4)]
    flat = {"1": 0.010, "4": 0.011, "12": 0.014}  # a wide pass nearly free: probes cost little
    steep = {"1": 0.010, "4": 0.016, "12": 0.035}
    cases = [(2, 0, flat, [(1, 1)]), (2, 0, steep, []), (ADAPT_ROWS + 1, 0, flat, []), (2, 2, flat, [])]
    for rows, kept, curve, want in cases:
        gen._batch_trees[0.0, rows], gen._batch_shapes = ((1, kept) if kept else (0, 0)), {}
        record = {"rows": rows, "depth": 1 if kept else 0, "total_tokens": kept, "top_k": 4, "candidates": candidates,
                  "forward_cost_s": curve, "best_estimate": {"depth": 1, "total_tokens": 1}}
        write_cached(autotune._batch_path(gen, rows, 0.0), record, "batch tuning record")
        got = gen.batch_shapes(rows)
        assert [(s.depth, s.total_tokens) for s in got] == want, rows
    shape, steep_curve = Shape(1, 1, 1.45, 1.55, 9, 3.0), {1: 1.0, 4: 1.6, 12: 3.5}
    assert probe_excess(shape, steep_curve, 8) == pytest.approx(1.55 + (1.6 + 0.75 * 1.9) - 1.4 - 1.45)  # 10 nodes
    assert probe_excess(shape, None, 8) == pytest.approx(0.1)


def test_adapting_generations_match_generate_and_change_nothing_cached(tmp_path, monkeypatch):
    """With the tuner's shapes set, generate adapts by itself (an untrained head accepts little: it drops to the
    plain loop and probes); the output is still generate's, and the shapes are per request."""
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    target = tiny_model("qwen2", vocab_size=80, seed=4)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=3, top_k=4, total_tokens=10)
    gen._shapes = [BIG, SMALL]
    prompt = torch.arange(3, 12)
    ref = target.generate(prompt[None], max_new_tokens=48, do_sample=False)
    out = gen.generate(prompt, max_new_tokens=48)
    assert torch.equal(out.sequences, ref)
    assert out.stats.plain_steps > 10 and sum(out.stats.shapes.values()) >= 3
    again = gen.generate(prompt, max_new_tokens=48)
    assert again.stats.shapes == out.stats.shapes  # decided from token counts: the same request, the same shapes
    gen.adapt = False
    fixed = gen.generate(prompt, max_new_tokens=48)
    assert torch.equal(fixed.sequences, ref) and fixed.stats.plain_steps == 0
    assert not list(tmp_path.rglob("*.json"))


def test_one_host_sync_per_cycle_in_the_plain_loop_and_while_adapting(counted):  # noqa: F811
    """The plain steps and the switches cost no extra host sync: one per cycle, as in a tree cycle."""
    target = tiny_model("llama", vocab_size=96)
    prompt = torch.tensor([5, 17, 33, 2, 60, 71])
    plain = SpecGenerator(target, NoTokenizer(), untrained_head(target), total_tokens=0)
    adapting = SpecGenerator(target, NoTokenizer(), untrained_head(target), top_k=4)
    adapting._shapes = [BIG, SMALL]
    for gen, temperature in ((plain, 0.0), (plain, 1.0), (adapting, 0.0), (adapting, 1.0)):
        per_cycle = syncs_per_cycle(gen, prompt, counted, temperature=temperature, top_p=0.9, top_k=20)
        assert len(per_cycle) > 10 and per_cycle == [1] * len(per_cycle), (temperature, per_cycle)


def test_shapes_cost_what_the_check_measured():
    """The tuner's shapes: its tree, the best depth for at most half the nodes and for at least twice as many; each
    cycle's cost scaled by how much dearer the check measured the timed trees than the curve estimated (the median)."""
    candidates = [{"depth": d, "total_tokens": n, "tau": 1 + 0.1 * n + 0.05 * d, "speedup": 1.2 - 0.01 * n - 0.02 * d}
                  for d in (1, 2, 3) for n in (1, 2, 4, 8)]
    rows = {(r["depth"], r["total_tokens"]): r for r in candidates}
    record = {"depth": 2, "total_tokens": 8, "candidates": candidates,
              "measured_speedup_over_plain": {"2x8": rows[2, 8]["speedup"] / 1.3, "3x4": rows[3, 4]["speedup"] / 1.1,
                                              "1x1": rows[1, 1]["speedup"] / 1.5, "1x0": 0.5}}
    assert cost_scale(record) == pytest.approx(1.3)  # the chain alone (no head node) is no tree of the table
    got = shapes(record, lookup=0)
    assert [(s.depth, s.total_tokens) for s in got] == [(2, 8), (1, 4), (1, 2)]  # none larger in the table
    small = shapes(record | {"depth": 1, "total_tokens": 1}, count=2)
    assert [(s.depth, s.total_tokens) for s in small] == [(1, 1), (1, 2), (1, 4)]  # up: twice the nodes, twice
    for shape in got:
        row = rows[shape.depth, shape.total_tokens]
        assert shape.cost == pytest.approx(1.3 * row["tau"] / row["speedup"])
    assert pass_cost(record) is None  # a one-prompt record has no batch curve
    assert pass_cost({"forward_cost_s": {"1": 0.02, "5": 0.03, "9": 0.05}}) == {1: 1.0, 5: 1.5, 9: 2.5}
    unchecked = shapes({k: v for k, v in record.items() if k != "measured_speedup_over_plain"})
    assert unchecked[0].cost == pytest.approx(rows[2, 8]["tau"] / rows[2, 8]["speedup"])
