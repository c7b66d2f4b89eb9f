"""Batched generation (griffin.batch): every row exactly its own generation, greedy and sampled; one host sync per
cycle; finished rows leave the batch; bad batches get clear errors; the tree is tuned per batch size."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from griffin import SpecGenerator
from griffin.adapt import Shape, ShapePolicy
from griffin.autotune import (
    ANSWER_TOKENS,
    CALIBRATION,
    FOLLOW_UP,
    PLAIN,
    _check_prompts,
    autotune_batch,
    batch_tuning_record,
)
from griffin.batch import BatchHeadDrafter, BatchOracle, BatchPromptLookup, batch_drafter, decode_rows
from griffin.decode import GenerationStats
from griffin.drafters import Context
from griffin.kv_cache import move_entries
from griffin.sampling import SamplingConfig
from tests.conftest import pooled_chisquare, tiny_model
from tests.test_engine import counted  # noqa: F401 - a fixture
from tests.test_generation import NoTokenizer, exact_sequences, untrained_head


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]


def reference(target, prompt: torch.Tensor, budget: int, eos: int | None = None) -> list[int]:
    """transformers' greedy generate of one prompt alone, cut after its first EOS."""
    out = target.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=budget,
                          do_sample=False, eos_token_id=eos, pad_token_id=0)[0, prompt.shape[0] :].tolist()
    return out[: out.index(eos) + 1] if eos is not None and eos in out else out


def check_rows_identity(family: str, rows: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Prompts of different lengths, trees of two shapes and no tree (the batched plain loop): each row's tokens are
    transformers' generate of that prompt alone, also for rows that stop early at an EOS."""
    target = tiny_model(family, vocab_size=96, seed=3).to(device=device, dtype=dtype)
    prompts = [p.to(device) for p in prompts_of([3 + 5 * (i % 4) + i for i in range(rows)], 96, seed=rows)]
    eos = reference(target, prompts[1], 30)[10]  # row 1 (at least) stops early at this EOS
    refs = [reference(target, p, 30, eos) for p in prompts]
    assert len(refs[1]) <= 11
    for depth, total in ((3, 10), (1, 3), (1, 0)):
        gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=depth, top_k=4, total_tokens=total,
                            draft_dtype=dtype)
        result = gen.generate([p.tolist() for p in prompts], max_new_tokens=30, eos_token_id=eos)
        assert result.tokens == refs, (depth, total)
        longest = max(p.shape[0] for p in prompts)
        for row, (p, new) in enumerate(zip(prompts, refs, strict=True)):
            assert result.sequences[row, longest - p.shape[0] : longest + len(new)].tolist() == p.tolist() + new


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("rows", [2, 4, 8])
def test_every_row_equals_its_own_greedy_generation(family, rows):
    check_rows_identity(family, rows)


@pytest.mark.parametrize("static", [True, False])
def test_rows_with_lookup_chains_equal_their_own_greedy_generation(static):
    """Each row's tree carries its own prompt-lookup chain (static: every row verifies all chain nodes; trimmed, the
    CPU default: the most real tokens any row found): every row is still its own greedy generation, and on prompts
    that repeat themselves the chains are accepted (τ above the same batch without them)."""
    target = tiny_model("llama", vocab_size=96, seed=3)
    prompts = [torch.tensor(([5, 17, 33, 2, 60, 71, 8, 12] * 3)[i:]) for i in (0, 3, 7)] + prompts_of([9], 96)
    refs = [reference(target, p, 24) for p in prompts]
    taus = {}
    for lookup in (0, 8):
        gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=2, top_k=3, total_tokens=4,
                            lookup=lookup)
        gen.static_shapes = static
        result = gen.generate([p.tolist() for p in prompts], max_new_tokens=24, eos_token_id=[])
        assert result.tokens == refs, lookup
        taus[lookup] = result.stats.tau
    assert taus[8] > taus[0] + 0.25, taus


def test_trimmed_chains_grow_with_what_the_target_accepts():
    """On the CPU each row earns its chain's length: it offers two tokens at first, twice as many after the target
    took all it offered, and what was taken after a miss; rows stay their own greedy generation."""
    target = tiny_model("llama", vocab_size=96, seed=3)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=2, top_k=3, total_tokens=4)
    prompts = [torch.tensor(([5, 17, 33, 2, 60, 71, 8, 12] * 3)[i:]) for i in (0, 3)]
    drafter = batch_drafter(gen.draft, 2, 3, 4, 2, 80, 8, trim=True)
    offers, limits = [], []  # per cycle: each row's offered chain tokens, and its limit before the cycle
    propose, accept, select = drafter.propose, drafter.accept, drafter.select

    def spy_propose(roots):
        limits.append(list(drafter.limits))
        trees = propose(roots)
        offers.append([len(o) for o in drafter.offered])
        return trees

    def spy_select(rows):  # finished rows leave between a cycle's proposal and its acceptance
        select(rows)
        offers[-1], limits[-1] = [offers[-1][r] for r in rows], [limits[-1][r] for r in rows]

    def spy_accept(tokens, hidden, counts, device_counts):
        taken = [next((i for i, (a, t) in enumerate(zip(o, row[:n])) if a != t), min(len(o), n))
                 for o, row, n in zip(drafter.offered, tokens.tolist(), counts, strict=True)]
        accept(tokens, hidden, counts, device_counts)
        for b, (offer, took) in enumerate(zip(offers[-1], taken, strict=True)):
            if offer:
                assert drafter.limits[b] == (min(8, 2 * limits[-1][b]) if took == offer else max(1, took))

    drafter.propose, drafter.accept, drafter.select = spy_propose, spy_accept, spy_select
    out = decode_rows(gen.backend, drafter, prompts, [40, 40], SamplingConfig(), gen.eos_ids([]), None,
                      GenerationStats())
    assert out == [reference(target, p, 40) for p in prompts]
    assert limits[0] == [2, 2] and max(offers[0]) <= 2
    assert all(o <= lim for offer, limit in zip(offers, limits) for o, lim in zip(offer, limit))
    assert max(max(lim) for lim in limits) == 8 and max(max(o) for o in offers) > 4  # a row that copies earns it all
    with pytest.raises(ValueError, match="earn=0"):
        BatchPromptLookup(drafter.inner, 8, 80, trim=True, earn=0)


def test_rows_accept_paths_of_different_lengths_in_the_same_cycle():
    """Two rows accept whole chains of 5 every cycle, two accept none: each row's KV entries are compacted after
    its own length, and every row still equals its own generation (budgets cut rows mid-chain)."""
    target = tiny_model("llama", vocab_size=64, seed=5)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=5, top_k=1, total_tokens=5)
    prompts = prompts_of([4, 9, 6, 12], 64, seed=1)
    refs = [reference(target, p, 40) for p in prompts]
    budgets = [40, 11, 37, 23]
    stats = GenerationStats()
    wrong = [r if row in (0, 2) else [(t + 1) % 64 for t in r] for row, r in enumerate(refs)]
    out = decode_rows(gen.backend, BatchOracle(wrong, 5), prompts, budgets, SamplingConfig(), gen.eos_ids([]), None,
                      stats)
    assert out == [r[:n] for r, n in zip(refs, budgets, strict=True)]
    assert stats.accepted_hist.get(6, 0) >= 10 and stats.accepted_hist.get(1, 0) >= 20


@pytest.mark.parametrize("chain", [1, 3, 6])
def test_the_batched_oracle_accepts_its_whole_chain_in_every_row(chain):
    """An oracle chain of K tokens per row is accepted whole in every cycle until the budget cuts it, and every row
    stays its own generation: the batched engine's ceiling is K+1 tokens per row and cycle."""
    target = tiny_model("qwen2", vocab_size=64, seed=2)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=1, top_k=1, total_tokens=1)
    prompts = prompts_of([5, 11, 8], 64, seed=4)
    refs = [reference(target, p, 1 + 4 * (chain + 1)) for p in prompts]
    stats = GenerationStats()
    out = decode_rows(gen.backend, BatchOracle(refs, chain), prompts, [len(r) for r in refs], SamplingConfig(),
                      gen.eos_ids([]), None, stats)
    assert out == refs
    assert stats.accepted_hist == {chain + 1: 4 * len(prompts)}


def test_a_left_padded_tensor_with_its_attention_mask_and_a_batch_of_one():
    target = tiny_model("llama", vocab_size=96, seed=3)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=2, top_k=3, total_tokens=5)
    prompts = prompts_of([5, 2, 8], 96)
    ids = torch.zeros(3, 8, dtype=torch.long)
    mask = torch.zeros(3, 8, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, 8 - p.shape[0] :], mask[row, 8 - p.shape[0] :] = p, 1
    result = gen.generate(ids, attention_mask=mask, max_new_tokens=12)
    assert result.tokens == [reference(target, p, 12) for p in prompts]
    one = gen.generate([prompts[1].tolist()], max_new_tokens=12)  # a batch of one: the one-prompt loop
    assert one.tokens == [gen.generate(prompts[1], max_new_tokens=12).sequences[0, 2:].tolist()]
    assert one.sequences.shape == (1, 2 + 12)


def test_finished_rows_leave_the_batch():
    """A row that stops after one cycle is dropped: later passes verify the other rows only."""
    target = tiny_model("llama", vocab_size=96, seed=3)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=2, top_k=3, total_tokens=5)
    rows_seen = []
    forward = gen.backend.forward_rows

    def spy(tokens, *args, **kwargs):
        rows_seen.append(tokens.shape[0])
        return forward(tokens, *args, **kwargs)

    gen.backend.forward_rows = spy
    drafter = BatchHeadDrafter(gen.draft, 2, 3, 5, 3, 40)
    stats = GenerationStats()
    out = decode_rows(gen.backend, drafter, prompts_of([4, 6, 5], 96), [2, 20, 9], SamplingConfig(),
                      gen.eos_ids([]), None, stats)
    assert [len(o) for o in out] == [2, 20, 9]
    assert rows_seen[0] == 3 and rows_seen[-1] == 1 and 2 in rows_seen
    assert rows_seen == sorted(rows_seen, reverse=True)


def count_calls(owner, name: str) -> list[int]:
    """Wrap ``owner.<name>`` so that each call adds one to the returned counter ([calls])."""
    counter, method = [0], getattr(owner, name)

    def wrapper(*args, **kwargs):
        counter[0] += 1
        return method(*args, **kwargs)

    setattr(owner, name, wrapper)
    return counter


def adapting_policy(plain_first: bool = False) -> ShapePolicy:
    """Two tree shapes an untrained head cannot pay for: the batch runs a tree, falls back to plain steps, probes
    (``plain_first``: as where the tuner kept no tree, the probes gated by the drafter)."""
    return ShapePolicy([Shape(3, 8, 2.0, 1.9, 4), Shape(1, 2, 1.5, 1.45, 2)], plain_first=plain_first)


@pytest.mark.parametrize("temperature,total,lookup,adapt", [(0.0, 8, 0, False), (1.0, 8, 0, False),
                                                            (0.0, 0, 0, False), (0.0, 8, 4, False),
                                                            (1.0, 8, 4, False), (0.0, 8, 4, True),
                                                            (1.0, 8, 0, True)])
def test_one_host_sync_per_cycle_for_the_whole_batch(counted, temperature, total, lookup, adapt):  # noqa: F811
    """Static shapes (what a GPU runs), a lookup chain included, the tree's shape adapting or fixed."""
    target = tiny_model("llama", vocab_size=96)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target, draft_vocab_size=40), depth=3, top_k=4,
                        total_tokens=total)
    passes = count_calls(gen.backend, "forward_rows")
    drafter = batch_drafter(gen.draft, 3, 4, total, 3, 40, lookup) if total else None
    generator = torch.Generator().manual_seed(0) if temperature else None
    counted[0] = 0
    stats = GenerationStats()
    decode_rows(gen.backend, drafter, prompts_of([6, 3, 9], 96), [16, 12, 16], SamplingConfig(temperature, 0.9),
                gen.eos_ids([]), generator, stats, adapting_policy() if adapt else None)
    assert passes[0] > 4 and counted[0] == 1 + passes[0]  # the prefill's, then one per batched pass
    assert (stats.plain_steps > 0 and bool(stats.shapes)) == adapt or not total


@pytest.mark.parametrize("lookup", [0, 3])
def test_a_batch_adapting_its_tree_keeps_every_row_its_own_generation(lookup):
    """The batch switches between two tree shapes and plain steps (whose tokens the drafter reads before the next
    tree); rows that finish early leave it in either kind of cycle: every row is still its own greedy generation."""
    target = tiny_model("llama", vocab_size=96, seed=3)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=3, top_k=4, total_tokens=8)
    # each prompt said four times, so that every row's context repeats its last 3-gram and the probes run
    prompts = [torch.cat([p] * 4) for p in prompts_of([5, 12, 3, 8], 96, seed=7)]
    budgets = [40, 9, 33, 40]
    refs = [reference(target, p, n) for p, n in zip(prompts, budgets, strict=True)]
    stats = GenerationStats()
    drafter = batch_drafter(gen.draft, 3, 4, 8, 4, 100, lookup, trim=bool(lookup))
    out = decode_rows(gen.backend, drafter, prompts, budgets, SamplingConfig(), gen.eos_ids([]), None, stats,
                      adapting_policy())
    assert out == refs
    assert stats.plain_steps > 0 and sum(stats.shapes.values()) > 2  # plain stretches and probes both ran


def test_a_batch_probes_only_where_every_rows_context_repeats_its_last_ngram():
    """On the CPU (trimmed chains) a probe that would find no chain to copy in some row is a plain step instead: a
    batch takes as many cycles as its slowest row, and the head's tree alone is what its tuner measured not paying."""
    target = tiny_model("llama", vocab_size=96, seed=3)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=3, top_k=4, total_tokens=8)
    prompts = prompts_of([5, 12, 3, 8], 96, seed=7)
    budgets = [40, 9, 33, 40]
    drafter = batch_drafter(gen.draft, 3, 4, 8, 4, 60, 3, trim=True)
    policy = adapting_policy(plain_first=True)
    probes, skipped = [], []
    propose, read = drafter.propose, drafter.read

    def spy_propose(roots):
        if policy.probing:
            probes.append(drafter.promising())
        return propose(roots)

    def spy_read(tokens, features):
        skipped.append(policy.probing)
        read(tokens, features)

    drafter.propose, drafter.read = spy_propose, spy_read
    out = decode_rows(gen.backend, drafter, prompts, budgets, SamplingConfig(), gen.eos_ids([]), None,
                      GenerationStats(), policy)
    assert out == [reference(target, p, n) for p, n in zip(prompts, budgets, strict=True)]
    assert probes and all(probes)  # every probe that ran had a chain in every row
    assert any(skipped)  # and some were plain steps instead
    assert BatchPromptLookup(drafter.inner, 3, 60, trim=False).promising()  # static chains: no reading, no gate
    drafter.contexts = [Context(8), Context(8)]
    drafter.contexts[0].reset(torch.tensor([1, 2, 3, 1, 2, 3]))
    drafter.contexts[1].reset(torch.tensor([7, 5, 6, 7, 5, 6]))
    assert drafter.promising()
    drafter.contexts[1].reset(torch.tensor([7, 5, 6, 7, 9, 5, 6]))  # its last 2-gram repeats, its last 3-gram not
    assert drafter.promising()
    drafter.contexts[1].reset(torch.tensor([7, 5, 6, 7, 9, 5, 8]))  # only a 1-gram (the lookup's are 3 and 2)
    assert not drafter.promising()


def test_a_batch_that_never_drafts_never_runs_the_head():
    """The head reads the prompts at the first tree, not before: a batch whose probes all wait for evidence that never
    comes (prompts of distinct tokens, a few new ones) costs exactly the batched plain loop's passes."""
    target = tiny_model("llama", vocab_size=96, seed=3)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=3, top_k=4, total_tokens=8)
    prompts = [torch.randperm(96, generator=torch.Generator().manual_seed(s))[:n] for s, n in ((1, 9), (2, 14))]
    drafter = batch_drafter(gen.draft, 3, 4, 8, 2, 60, 3, trim=True)
    calls = count_calls(gen.draft, "forward")
    stats = GenerationStats()
    out = decode_rows(gen.backend, drafter, prompts, [4, 4], SamplingConfig(), gen.eos_ids([]), None, stats,
                      adapting_policy(plain_first=True))
    assert out == [reference(target, p, 4) for p in prompts]
    assert stats.plain_steps == 6 and not stats.shapes and calls[0] == 0


@pytest.mark.parametrize("total", [8, 0])
def test_a_cycle_sends_nothing_to_the_device(monkeypatch, total):
    """Each row's length, budget and last emitted index stay on the device between cycles: a host list copied to
    the device is a hidden sync on a GPU (a copy from pageable memory waits for the queued work). So the number of
    tensors built from host data does not grow with the cycles (three copies of one prompt: the rows accept alike
    and finish together, so none leaves the batch early)."""
    target = tiny_model("llama", vocab_size=96)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target, draft_vocab_size=40), depth=3, top_k=4,
                        total_tokens=total)
    built = [0]
    tensor = torch.tensor

    def counting(*args, **kwargs):
        built[0] += 1
        return tensor(*args, **kwargs)

    def uploads(budget: int) -> tuple[int, int]:
        drafter = BatchHeadDrafter(gen.draft, 3, 4, total, 3, 40) if total else None
        stats = GenerationStats()
        built[0] = 0
        monkeypatch.setattr(torch, "tensor", counting)
        decode_rows(gen.backend, drafter, prompts_of([6], 96) * 3, [budget] * 3, SamplingConfig(),
                    gen.eos_ids([]), None, stats)
        monkeypatch.setattr(torch, "tensor", tensor)
        return built[0], stats.new_tokens

    (short, few), (long, many) = uploads(4), uploads(24)
    assert many >= few + 3 * 12 and long == short


@pytest.mark.parametrize("lookup,trim", [(0, False), (2, False), (2, True)])
def test_sampling_per_row_matches_each_prompts_distribution(lookup, trim):
    """Batch of two prompts at temperature 0.8 and top-k 3, trees of depth 2 (with a prompt-lookup chain of two
    tokens, static or trimmed): the first four tokens of each row follow that prompt's exact distribution under the
    target (chi-square), whatever the other row drew."""
    target = tiny_model("llama", vocab_size=5, hidden=16, layers=1, seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # a spread-out distribution
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target, "eagle"), depth=2, top_k=2, total_tokens=3)
    prompts = [torch.tensor([1, 3, 0]), torch.tensor([4, 2])]
    cfg = SamplingConfig(temperature=0.8, top_k=3)
    exact = [exact_sequences(target, p, cfg, length=4) for p in prompts]
    counts: list[dict[tuple, int]] = [{}, {}]
    runs, accepted = 1500, 0
    for seed in range(runs):
        drafter = batch_drafter(gen.draft, 2, 2, 3, 2, 8, lookup, (1,), trim)
        stats = GenerationStats()
        out = decode_rows(gen.backend, drafter, prompts, [4, 4], cfg, gen.eos_ids([]),
                          torch.Generator().manual_seed(seed), stats)
        for row in range(2):
            counts[row][tuple(out[row])] = counts[row].get(tuple(out[row]), 0) + 1
        accepted += stats.new_tokens - 2 - stats.cycles
    assert accepted > runs // 4  # drafted tokens were accepted: the trees took part
    for row in range(2):
        assert set(counts[row]) <= set(exact[row]), "sampled a sequence the target cannot produce under top-k 3"
        pvalue, cells = pooled_chisquare(counts[row], exact[row], runs)
        assert cells > 20 and pvalue > 0.001, (row, pvalue)


BAD_BATCHES = [
    (dict(inputs=[]), "the prompt is empty"),
    (dict(inputs=[[1, 2], []]), "the prompt is empty"),
    (dict(inputs=torch.ones(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 3)), "attention_mask has shape"),
    (dict(inputs=torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])),
     "pad on the left"),
    (dict(inputs=[1, 2, 3], attention_mask=torch.ones(1, 3)), "attention_mask goes with"),
    (dict(inputs=[[1, 2], [3]], streamer=object()), "streamer and drafter take one prompt"),
]


@pytest.mark.parametrize("kwargs,message", BAD_BATCHES, ids=[str(i) for i in range(len(BAD_BATCHES))])
def test_bad_batches_raise_value_errors_naming_the_fix(kwargs, message):
    target = tiny_model("llama", vocab_size=32)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=2, top_k=2, total_tokens=3)
    with pytest.raises(ValueError, match=message):
        gen.generate(max_new_tokens=4, **kwargs)
    with pytest.raises(ValueError, match="stream takes one prompt"):
        next(gen.stream([[1, 2], [3, 4]]))


@pytest.mark.parametrize("tree_cost,expected", [(5.0, PLAIN), (1.1, (3, 10))])
def test_the_tuner_picks_the_tree_per_batch_size_down_to_no_tree(tmp_path, monkeypatch, tree_cost, expected):
    """The per-batch-size tuner on a cost model: where a pass of several tokens per row costs five one-token passes
    (a large batch) no tree is expected to pay, the check confirms it and the batched plain loop is chosen; where it
    costs 1.1 the larger tree wins. The choice is cached per batch size beside the one-prompt record."""
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    target = tiny_model("llama", vocab_size=96, seed=3)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=3, top_k=4, total_tokens=10)
    record = {"candidates": [{"depth": 3, "total_tokens": 10, "tau": 1.6, "speedup": 1.2},
                             {"depth": 1, "total_tokens": 2, "tau": 1.2, "speedup": 1.1}], "cycle_overhead_s": 0.0}
    monkeypatch.setattr("griffin.autotune.tuning_record", lambda gen, temperature: record)
    monkeypatch.setattr("griffin.autotune.forward_cost_rows",
                        lambda gen, rows, sizes, **kw: {n: 1.0 if n == 1 else tree_cost for n in sizes})
    monkeypatch.setattr("griffin.autotune.draft_level_rows", lambda gen, rows: 0.0)
    tau = {(3, 10): 1.6, (1, 2): 1.2, PLAIN: 1.0}  # seconds per token: the plain step's over each tree's tau

    def measured(gen, prompts, tree, max_new_tokens, temperature, seed):
        return (1.0 if tree == PLAIN else tree_cost) / tau[tree] * (1 + 0.001 * seed)

    monkeypatch.setattr("griffin.autotune._rows_seconds_per_token", measured)
    monkeypatch.setattr("griffin.autotune._check_prompts", lambda gen: ([torch.tensor([1, 2, 3])],) * 2)
    assert autotune_batch(gen, 4) == expected
    estimates = {(r["depth"], r["total_tokens"]): r["speedup"] for r in
                 __import__("json").loads(next((tmp_path / "autotune").glob("*-B4-v2.json")).read_text())["candidates"]}
    assert (max(estimates.values()) < 1) == (expected == PLAIN)
    assert gen.batch_tree(4) == (3, 10)  # a fixed tree (not tuned) is the generator's own


@pytest.mark.parametrize("first,second,kept", [(1.0, 1.2, True), (0.9, 1.5, False), (1.01, 1.01, False)])
def test_the_batch_tuner_weighs_first_and_second_turns(tmp_path, monkeypatch, first, second, kept):
    """A batch size's check times first and second turns alternately: a tree that only breaks even on first turns
    but pays on second turns is kept, one that loses on first turns is not, however much it gains on second turns,
    and one that gains less than the margin on both is not."""
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    target = tiny_model("llama", vocab_size=96, seed=3)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=1, top_k=4, total_tokens=2)
    record = {"candidates": [{"depth": 1, "total_tokens": 2, "tau": 1.3, "speedup": 1.1}], "cycle_overhead_s": 0.0}
    monkeypatch.setattr("griffin.autotune.tuning_record", lambda gen, temperature: record)
    monkeypatch.setattr("griffin.autotune.forward_cost_rows", lambda gen, rows, sizes, **kw: {n: 1.0 for n in sizes})
    monkeypatch.setattr("griffin.autotune.draft_level_rows", lambda gen, rows: 0.0)
    firsts, seconds = [torch.tensor([1, 2, 3])], [torch.tensor([1, 2, 3, 4, 5])]
    monkeypatch.setattr("griffin.autotune._check_prompts", lambda gen: (firsts, seconds))

    def measured(gen, prompts, tree, max_new_tokens, temperature, seed):
        gain = 1.0 if tree == PLAIN else first if prompts[0] is firsts[0] else second
        return (1 + 0.001 * seed) / gain

    monkeypatch.setattr("griffin.autotune._rows_seconds_per_token", measured)
    assert autotune_batch(gen, 2) == ((1, 2) if kept else PLAIN)
    by_turn = batch_tuning_record(gen, 2)["measured_by_turn"]["1x2"]
    assert by_turn == pytest.approx({"first": first, "second": second}, abs=0.01)


def test_the_batch_tuner_s_second_turns_restate_the_first_answer(tiny_target_dir):
    """The check's second turns: the first turn, the target's own greedy answer to it, then the follow-up, each in
    the chat template."""
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    gen = SpecGenerator(target, tokenizer, untrained_head(target), depth=1, top_k=4, total_tokens=2)
    firsts, seconds = _check_prompts(gen)
    assert len(firsts) == len(seconds) == len(CALIBRATION)
    for ids, follow_up, prompt in zip(firsts, seconds, CALIBRATION, strict=True):
        answer = decode_rows(gen.backend, None, [ids], [ANSWER_TOKENS], SamplingConfig(), gen.eos_ids(None), None,
                             GenerationStats())[0]
        text = tokenizer.decode(follow_up)
        assert text.startswith(tokenizer.decode(ids)[: -len("<|im_start|>assistant\n")]) and prompt in text
        assert tokenizer.decode(answer, skip_special_tokens=True).strip() in text
        assert text.rstrip().endswith(f"{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant")


def test_rows_identical_to_their_own_generation_on_the_embedded_target(embedded):
    """The embedded SmolLM2 target in fp32 with the shipped head: chats of different lengths at batch 2, 4 and 8,
    every row's tokens equal to that chat's own generation (and to transformers' generate of it alone)."""
    model, tokenizer = embedded
    gen = SpecGenerator.from_pretrained(model, tokenizer=tokenizer, depth=3, total_tokens=6)
    questions = ["Write a haiku about the sea.", "What is 17 times 3? Show the steps.", "Name three primary colours.",
                 "Give two tips for writing clean code, briefly.", "Translate 'good morning' into French.",
                 "Describe Paris in one sentence.", "List the first five prime numbers.", "What does a CPU do?"]
    chats = [[{"role": "user", "content": q}] for q in questions]
    own = [gen.chat(chat, max_new_tokens=16).sequences[0] for chat in chats]
    ids = [gen.encode(chat) for chat in chats]
    # the own generation is transformers' (checked for one chat here; the one-prompt tests check more)
    assert own[5].tolist() == model.generate(ids[5][None], attention_mask=torch.ones_like(ids[5][None]),
                                             max_new_tokens=16, do_sample=False)[0].tolist()[: own[5].shape[0]]
    accepted = 0
    for rows in (2, 4, 8):
        result = gen.chat(chats[:rows], max_new_tokens=16)
        assert result.tokens == [o[p.shape[0] :].tolist() for o, p in zip(own[:rows], ids, strict=False)], rows
        accepted += result.stats.new_tokens - result.stats.cycles - rows
    assert accepted > 15  # the trained head's drafts were accepted


@pytest.mark.parametrize("shape", [(2, 3, 12, 4), (5, 2, 2, 3, 12, 4)])  # a draft cache; all target layers' K and V
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_entries_moves_each_rows_own_slots_reading_all_before_writing(shape, dtype):
    """Overlapping moves (slot 7 -> 6 while 6 -> 5) read the old entries; other slots and rows stay as they were."""
    buf = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    source, target = torch.tensor([[6, 7, 9], [8, 10, 11]]), torch.tensor([[5, 6, 7], [2, 3, 4]])
    expected = buf.clone()
    for b in range(2):
        expected[..., b, :, target[b], :] = buf[..., b, :, source[b], :]
    move_entries(buf, source, target)
    assert torch.equal(buf, expected)
