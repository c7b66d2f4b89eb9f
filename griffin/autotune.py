"""``total_tokens="auto"``: choose the tree size and depth that maximise the speedup on this machine, in seconds.

Bounded in time (``budget_s``, 45 s by default, plus the check's least turns; a progress bar shows it) and robust
to a busy machine:

1. Calibration (45 % of the budget): a few generic requests (not evaluation questions) are generated with a large
   tree at the temperature being tuned for (greedily at 0, else sampled with fixed seeds); for every cycle the
   draft-score rank and depth of each node on the accepted path are recorded. A smaller tree of ``N`` nodes and depth
   ``d`` is the ``N`` best-ranked nodes of depth <= d of the same candidates, so the tokens it would have accepted
   follow from those ranks (never more than the large tree accepted: the measured acceptance bounds every estimate).
   When sampling the estimate holds in distribution: the verifier draws one token per node from the target and
   follows the child that carries it (:class:`griffin.verify.TreeSampling`), so with the same draws a cut tree would
   accept the prefix of the traced path that it kept. The head's cost per drafting level and the per-cycle overhead
   are timed too.
   With a prompt-lookup chain of K tokens (``lookup=K``) the calibration trees carry it, and a smaller tree keeps the
   path's nodes that the chain spells, whether the head drafted them too or not. K itself is not tuned: the
   calibration requests are first turns, where little text repeats, so they would undervalue the chain (on MT-Bench
   in bf16 it raised τ from about 2 to 3.02).
2. The target's forward-cost curve ``t(n)`` (25 %): interleaved repeats over the sizes of the candidate trees,
   medians, made non-decreasing in ``n`` (a busy moment cannot make a larger pass look cheaper than a smaller one);
   sizes between two measured ones are interpolated.
3. Expected speedup over plain decoding = ``tau(N, d) * t(1) / (t(n) + d * draft_level + overhead)``, where n is
   the nodes a cycle verifies: ``N + 1 + K`` with static shapes, and on the CPU (where a chain is cut to its real
   tokens, :class:`griffin.drafters.PromptLookup`) their mean over the calibration cycles had the trees been cut.
4. Check (30 %): the best candidate, a small default tree (with the whole chain) and the plain loop itself
   (:func:`griffin.plain.plain_steps`; with a chain, also the chain alone) generate the calibration prompts in turns,
   at the band's temperature (sampled with the same seed in each turn; at least :data:`MIN_TURNS` turns, past the
   budget if need be, since noise cannot be told from fewer). A tree is chosen only if the median of its
   paired speedups over the plain loop beats 1 by more than the measured noise (the spread of those ratios) and
   :data:`MIN_GAIN`; else decoding runs the plain loop. Too little calibration data falls back to the default tree.
5. Shapes for adaptation (:func:`shapes`): the chosen tree and smaller ones from the same table, which
   :class:`griffin.adapt.ShapePolicy` switches between per request, down to the plain loop.

**Temperature.** Sampling accepts far less than greedy decoding (on MT-Bench with the embedded target and a 10-token
lookup chain, fp32: τ 1.40 at T=1 against 2.98 at T=0, ``benchmarks/results/mt_bench-*-lookup10-T*.md``), so the best
tree differs: a tree is tuned per temperature band (:func:`temperature_band`: 0 for greedy, else the temperature
rounded to 0.1). :class:`griffin.SpecGenerator` tunes the greedy tree when it is loaded and a sampled band the first
time a generation asks for it.

The choice is cached per machine, target, dtype, head and temperature band under ``<griffin cache>/autotune/`` with
the reason for it; ``retune=True`` (``--retune`` on the commands) measures again, ``total_tokens=N`` skips the tuning.
A choice that the machine's load decided rather than the trees (too few calibration cycles fitted in the time, or a
tree measured faster than the plain loop but not beyond the noise) is marked ``unsettled`` and tuned again at the next
loads, :data:`SETTLE_TRIES` tunings in all, so that a quiet start can settle it; the batch sizes' records likewise.
A standalone draft LM's chain length is tuned here too (:func:`tune_gamma`). The tuner drives the decode loop
(:func:`griffin.decode.decode`) with drafters and caches of its own; it reads a generator's public parts and never
changes them.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator

import numpy
import torch

from .adapt import Shape
from .batch import BatchHeadDrafter, batch_drafter, decode_rows
from .chat_template import TemplateError
from .decode import GenerationStats, decode
from .draft_lm import DraftLM
from .drafters import DraftLMDrafter, head_drafter
from .io import check_integer, read_cached, write_cached
from .kernels import cpu_name
from .kv_cache import BufferCache, RowsCache
from .progress import progress
from .sampling import SamplingConfig
from .target import cache_dir, target_fingerprint

log = logging.getLogger(__name__)

CALIBRATION = [
    "Explain how a bicycle works.",
    "Write a short story about a lighthouse keeper.",
    "Give three tips for staying focused while studying.",
    "What are the health benefits of drinking water?",
]
MAX_DEPTH, MAX_TOTAL = 6, 48  # the calibration tree; every candidate is a sub-tree of it
TOTALS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48]
DEFAULT_TREE = (3, 6)  # depth, total_tokens: small enough to be cheap on any machine, large enough to help
NO_TREE = (1, 0)  # no head node: the plain loop (with a chain, the chain alone)
PLAIN = (0, 0)  # nothing drafted, the chain neither: the plain loop (a choice only apart from NO_TREE with a chain)
MIN_GAIN = 0.02  # a tree must beat the plain loop by this much beyond the measured noise
CHECK_TOKENS, CHECK_TURNS, MIN_TURNS = 32, 6, 3  # per generation; turns at most and at least
MIN_CYCLES = 8  # fewer calibration cycles than this: too little data to trust, keep the default
SETTLE_TRIES = 3  # tunings in all of a choice that the machine's load decided (an "unsettled" record)
BUDGET_S = 45.0
SPLIT = {"calibration": 0.45, "forward cost": 0.25, "check": 0.30}


def temperature_band(temperature: float) -> float:
    """The temperature a tree is tuned at for generations at ``temperature``: 0 (greedy) or it rounded to 0.1."""
    return 0.0 if temperature == 0 else max(0.1, round(float(temperature), 1))


def _record_path(gen, temperature: float):
    """Where this machine's tuning record for ``gen`` at the band ``temperature`` is cached."""
    return cache_dir() / "autotune" / f"{_key(gen, temperature)}.json"


def _key(gen, temperature: float) -> str:
    weight = gen.draft.fusion.fc.weight.detach().float().cpu().numpy().tobytes()
    parts = [target_fingerprint(gen.target.config), str(gen.lm_head.weight.dtype), str(gen.device),
             cpu_name(), str(torch.get_num_threads()), str(gen.top_k),
             str(gen.weight_major.max_rows), gen.weight_major.describe(), str(gen.lookup), str(gen.static_shapes),
             str(gen.lookup_ngrams),
             f"T={temperature}", hashlib.sha256(weight).hexdigest()[:16]]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


@torch.inference_mode()
def forward_cost(gen, sizes: list[int], context: int = 256, repeats: int = 5,
                 deadline: float | None = None) -> dict[int, float]:
    """Median seconds of one target forward over n new tokens after ``context`` cached ones.

    Sizes are interleaved in every repeat so that machine noise spreads over all of them; with ``deadline``, repeats
    stop when it passes (at least one is made)."""
    window = getattr(gen.target.config.get_text_config(), "max_position_embeddings", None)
    if isinstance(window, int):
        context = max(1, min(context, window - max(sizes)))
    forward = cached_context_forward(gen, context, max(sizes))
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats):
        if r and deadline is not None and time.perf_counter() > deadline:
            break
        for n in sizes:
            _sync(gen.device)
            t0 = time.perf_counter()
            forward(n)
            _sync(gen.device)
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def cached_context_forward(gen, context: int, max_new: int) -> Callable[[int], None]:
    """Prefill ``context`` random tokens; -> ``forward(n)``: one causal target forward over n <= ``max_new`` new
    tokens on top of them, the cache cropped back to the context afterwards."""
    ids = torch.randint(0, gen.target.config.vocab_size, (context + max_new,), device=gen.device)
    cache = BufferCache(gen.num_layers, context + max_new)
    causal = torch.ones(context, context, dtype=torch.bool, device=gen.device).tril()
    gen.backend.forward(ids[:context], torch.arange(context, device=gen.device), causal, cache,
                        last_logits_only=True)

    @torch.inference_mode()
    def forward(n: int) -> None:
        mask = torch.ones(n, n, dtype=torch.bool, device=gen.device).tril()
        gen.backend.forward(ids[context : context + n], torch.arange(context, context + n, device=gen.device), mask,
                            cache)
        cache.crop(context)

    return forward


def cut_tree_yield(trace: list, total: int, depth: int) -> tuple[float, float]:
    """-> (mean tokens per cycle, mean nodes verified per cycle, the root included) had the traced trees been cut to
    ``total`` head nodes of depth <= ``depth``. The nodes of a prompt-lookup chain grafted onto a traced tree (its last
    ``tree.grafted`` nodes) stay in every cut tree, with the head's nodes above the first of them (graft hangs the
    chain below the deepest node that spells its start): the chain spells their path whatever the head's part is."""
    accepted, verified = [], []
    for tree, path in trace:
        depths, ranks = tree.depths, tree.ranks()
        head = torch.arange(tree.size, device=depths.device) < tree.size - tree.grafted
        allowed = (depths <= depth) & head
        order = torch.argsort(torch.where(allowed, ranks, ranks.max() + 1))
        kept = torch.zeros_like(allowed)
        kept[order[: total + 1]] = True  # the root and the `total` best allowed nodes
        kept &= allowed
        if tree.grafted:
            real = ~head if tree.valid is None else ~head & tree.valid
            kept |= tree.ancestors[real].any(dim=0) | real  # chain nodes and every node above them
        inside = kept[path[1:]]
        accepted.append(int(inside.int().cumprod(0).sum()) + 1)
        verified.append(int(kept.sum()))
    return sum(accepted) / len(accepted), sum(verified) / len(verified)


class _Clock:
    """Wall time against the budget, shown as a progress bar in seconds."""

    def __init__(self, budget_s: float):
        self.start = time.perf_counter()
        self.budget = budget_s
        self.bar = progress(total=round(budget_s), desc="tuning the draft tree (once)", unit="s", leave=False,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s")

    def deadline(self, phase: str) -> float:
        """When ``phase`` must end: its share of the budget after the earlier phases' shares."""
        shares = list(SPLIT)
        return self.start + self.budget * sum(SPLIT[p] for p in shares[: shares.index(phase) + 1])

    def tick(self, phase: str) -> None:
        self.bar.set_postfix_str(phase)
        self.bar.n = min(self.elapsed, self.budget)
        self.bar.refresh()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def close(self) -> None:
        self.bar.close()


def _calibration_prompts(gen) -> list[torch.Tensor]:
    prompts = []
    for prompt in CALIBRATION:
        try:
            prompts.append(gen.encode([{"role": "user", "content": prompt}]))
        except TemplateError:  # a base model without a chat template
            prompts.append(gen.encode(prompt))
    return prompts


def calibration_sampling(gen, temperature: float, seed: int) -> tuple[SamplingConfig, torch.Generator | None]:
    """-> (SamplingConfig, torch.Generator or None) of a calibration generation at ``temperature``."""
    if temperature == 0:
        return SamplingConfig(), None
    return SamplingConfig(temperature), torch.Generator(device=gen.device).manual_seed(seed)


def run(gen, tree: tuple[int, int], ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int,
        stats: GenerationStats, timing: bool = False, trace: list | None = None) -> Iterator[torch.Tensor]:
    """Generate from ``ids`` with the tree (depth, total_tokens) on ``gen``'s target and head, through the decode
    loop with a drafter and a KV cache of its own (``gen`` is only read): its chunks of new tokens.
    :data:`PLAIN` (and :data:`NO_TREE` without a chain) is the plain loop."""
    depth, total = tree
    lookup = 0 if tree == PLAIN else gen.lookup
    capacity = ids.shape[0] + max_new_tokens
    drafter = None if total == 0 and not lookup else head_drafter(gen.draft, depth, gen.top_k, total, capacity,
                                                                  lookup, gen.lookup_ngrams, not gen.static_shapes)
    cache = BufferCache(gen.num_layers, capacity + (drafter.total_tokens if drafter else 0) + 1)
    sampling, generator = calibration_sampling(gen, temperature, seed)
    return decode(gen.backend, drafter, ids, max_new_tokens, sampling, gen.eos_ids(None), generator, stats, cache,
                  timing=timing, trace=trace)


def _calibrate(gen, clock: _Clock, max_new_tokens: int, temperature: float) -> tuple[list, dict]:
    deadline = clock.deadline("calibration")
    trace: list = []
    totals = {"draft_s": 0.0, "other_s": 0.0, "cycles": 0, "new_tokens": 0}
    for seed, ids in enumerate(_calibration_prompts(gen)):
        stats = GenerationStats()  # timed: the draft time per cycle is needed
        for _ in run(gen, (MAX_DEPTH, MAX_TOTAL), ids, max_new_tokens, temperature, seed, stats, True, trace):
            clock.tick("calibration")
            if time.perf_counter() > deadline:
                break
        totals["draft_s"] += stats.draft_s
        totals["other_s"] += stats.other_s
        totals["cycles"] += stats.cycles
        totals["new_tokens"] += stats.new_tokens - 1  # the prefill's token is no cycle's
        if time.perf_counter() > deadline:
            break
    return trace, totals


def _seconds_per_token(gen, ids: torch.Tensor, tree: tuple[int, int], max_new_tokens: int, temperature: float,
                       seed: int) -> float:
    stats = GenerationStats()
    _sync(gen.device)
    t0 = time.perf_counter()
    for _ in run(gen, tree, ids, max_new_tokens, temperature, seed, stats):
        pass
    _sync(gen.device)
    return (time.perf_counter() - t0) / stats.new_tokens


def _check(gen, clock: _Clock, trees: list[tuple[int, int]], max_new_tokens: int,
           temperature: float) -> dict[tuple[int, int], list[float]]:
    """Seconds per token of each of ``trees`` (depth, total_tokens), generated in turns: each turn one calibration
    prompt (in rotation) and, when sampling, one seed for all."""
    prompts = _calibration_prompts(gen)
    deadline = clock.deadline("check")
    times: dict[tuple[int, int], list[float]] = {tree: [] for tree in trees}
    for turn in itertools.count():
        ids = prompts[turn % len(prompts)]
        for tree in trees:
            times[tree].append(_seconds_per_token(gen, ids, tree, max_new_tokens, temperature, turn))
            clock.tick("check")
        if turn + 1 >= CHECK_TURNS or (turn + 1 >= MIN_TURNS and time.perf_counter() > deadline):
            break
    return times


def paired_speedup(plain: list[float], other: list[float]) -> tuple[float, float]:
    """Seconds per token of the plain loop and another method in the same turns -> (median of the per-turn speedups
    plain / other, their noise: the median absolute deviation of those speedups, scaled to a standard deviation)."""
    ratios = [p / o for p, o in zip(plain, other, strict=True)]
    middle = statistics.median(ratios)
    return middle, 1.4826 * statistics.median(abs(r - middle) for r in ratios)


def _within_noise(paired: dict) -> bool:
    """Whether a tree measured faster than the plain loop by more than :data:`MIN_GAIN` but not beyond its noise:
    the plain loop kept because the machine was too noisy to tell, not because no tree pays."""
    return any(1 + MIN_GAIN < gain <= 1 + MIN_GAIN + noise for gain, noise in paired.values())


def _cached(path, what: str, retune: bool) -> tuple[dict | None, int]:
    """-> (the record cached at ``path`` to use, or None to tune again; the tunings that record stands for). None when
    ``retune``, when there is no record or a damaged one (``what``: its name in logs), and when it is unsettled and
    tuned fewer than :data:`SETTLE_TRIES` times."""
    record = None if retune else read_cached(path, what, checked_choice, "tuning again")
    tries = _tries(record)
    if record is not None and record.get("unsettled") and tries < SETTLE_TRIES:
        log.info("the cached %s was decided by the machine's load (%s): tuning again, %d of at most %d tunings",
                 what, record["unsettled"], tries + 1, SETTLE_TRIES)
        return None, tries
    return record, tries


def _tries(record: dict | None) -> int:
    """How many tunings a cached record stands for (0: no record)."""
    if record is None:
        return 0
    tries = record.get("tries", 1)
    return tries if isinstance(tries, int) and not isinstance(tries, bool) and tries >= 1 else 1


def _name(tree: tuple[int, int], lookup: int = 0) -> str:
    names = {PLAIN: "the plain loop", NO_TREE: "the lookup chain alone" if lookup else "the plain loop",
             DEFAULT_TREE: "the default tree"}
    return names.get(tree, f"{tree[1]} nodes, depth {tree[0]}")


def interpolate(costs: dict[int, float], n: float) -> float:
    """t(n) from the measured sizes: linear between the two nearest, the nearest end outside them."""
    sizes = sorted(costs)
    return float(numpy.interp(n, sizes, [costs[s] for s in sizes]))


def tune(gen, budget_s: float | None = None, max_new_tokens: int = 64, temperature: float = 0.0) -> dict:
    """Measure and choose for generations at ``temperature``; -> the choice with its reason and measurements (see the
    module docstring)."""
    budget_s = budget_s or BUDGET_S
    clock = _Clock(budget_s)
    try:
        # one-time costs of the first calls: untimed
        for tree in ((MAX_DEPTH, MAX_TOTAL), PLAIN):
            _seconds_per_token(gen, _calibration_prompts(gen)[0], tree, 4, temperature, 0)
        trace, totals = _calibrate(gen, clock, max_new_tokens, temperature)
        cycles = totals["cycles"]
        measured_tau = (totals["new_tokens"] / cycles) if cycles else 1.0
        choice: dict = {"top_k": gen.top_k, "temperature": temperature, "calibration_cycles": cycles,
                        "calibration_tau": measured_tau, "budget_s": budget_s}
        if cycles < MIN_CYCLES:
            depth, total = DEFAULT_TREE
            reason = f"the default tree: only {cycles} calibration cycles fitted in the time (machine too busy?)"
            choice.update(depth=depth, total_tokens=total, lookup=gen.lookup, reason=reason, tuning_s=clock.elapsed,
                          unsettled="too few calibration cycles")
            return choice
        sizes = sorted({1} | {n + 1 for n in TOTALS} | {n + 1 + gen.lookup for n in TOTALS[:: 3]})
        costs = forward_cost(gen, sizes, context=128, repeats=7, deadline=clock.deadline("forward cost"))
        clock.tick("forward cost")
        running = 0.0
        for n in sorted(costs):  # non-decreasing in n: noise never makes a larger pass look cheaper
            running = costs[n] = max(costs[n], running)
        level = totals["draft_s"] / cycles / MAX_DEPTH  # the update pass plus depth-1 expansions per cycle
        overhead = totals["other_s"] / cycles
        table = []
        for depth in range(1, MAX_DEPTH + 1):
            for total in TOTALS:
                tau, nodes = cut_tree_yield(trace, total, depth)
                tau = min(tau, measured_tau)
                nodes = total + 1 + gen.lookup if gen.static_shapes else nodes  # static: the chain's padding too
                speedup = tau * costs[1] / (interpolate(costs, nodes) + depth * level + overhead)
                table.append({"depth": depth, "total_tokens": total, "tau": tau, "speedup": speedup, "nodes": nodes})
        best = max(table, key=lambda row: row["speedup"])
        pick = (best["depth"], best["total_tokens"])
        if gen.lookup:  # the chain alone: no drafting, the loop's overhead stays
            tau, nodes = cut_tree_yield(trace, 0, 1)
            tau = min(tau, measured_tau)
            nodes = 1 + gen.lookup if gen.static_shapes else nodes
            table.append({"depth": NO_TREE[0], "total_tokens": 0, "tau": tau, "nodes": nodes,
                          "speedup": tau * costs[1] / (interpolate(costs, nodes) + overhead)})
        plain = PLAIN if gen.lookup else NO_TREE
        table.append({"depth": plain[0], "total_tokens": 0, "tau": 1.0, "speedup": 1.0})
        rows = {(row["depth"], row["total_tokens"]): row for row in table}
        contenders = list(dict.fromkeys([pick, DEFAULT_TREE, *([NO_TREE] if gen.lookup else []), plain]))
        times = _check(gen, clock, contenders, CHECK_TOKENS, temperature)
        measured = {tree: statistics.median(t) for tree, t in times.items()}
        paired = {tree: paired_speedup(times[plain], times[tree]) for tree in contenders if tree != plain}
        paying = [tree for tree, (gain, noise) in paired.items() if gain > 1 + MIN_GAIN + noise]
        winner = min(paying, key=measured.__getitem__) if paying else plain
        against = ", ".join(f"{_name(t, gen.lookup)} {gain:.2f}x ± {noise:.2f}" for t, (gain, noise) in paired.items())
        if winner == plain:
            reason = (f"the plain loop: no tree beat it by more than the noise (median paired speedups over it: "
                      f"{against}; the best estimate was {_name(pick)}, {best['speedup']:.2f}x)")
            if _within_noise(paired):
                choice["unsettled"] = "a tree measured faster than the plain loop, within the noise"
        else:
            reason = (f"{_name(winner, gen.lookup)}: measured fastest, {paired[winner][0]:.2f}x the plain loop "
                      f"(median of {len(times[plain])} paired turns; all: {against}; expected tau "
                      f"{rows[winner]['tau']:.2f})")
        choice.update(depth=winner[0], total_tokens=winner[1], lookup=0 if winner == PLAIN else gen.lookup,
                      reason=reason, expected_tau=rows[winner]["tau"], expected_speedup=rows[winner]["speedup"],
                      forward_cost_s=costs, draft_level_s=level, cycle_overhead_s=overhead,
                      measured_s_per_token={f"{d}x{n}": s for (d, n), s in measured.items()},
                      measured_speedup_over_plain={f"{d}x{n}": g for (d, n), (g, _) in paired.items()},
                      best_estimate={"depth": pick[0], "total_tokens": pick[1]}, candidates=table,
                      tuning_s=clock.elapsed)
        return choice
    finally:
        clock.close()


def shapes(choice: dict, lookup: int = 0, count: int = 3, larger: int = 2) -> list[Shape]:
    """The tree shapes adaptation switches between (:class:`griffin.adapt.ShapePolicy`) for a tuning record: the tree
    it chose (where it chose none, its best estimate), then up to ``count - 1`` smaller ones, each the best depth for
    at most half the nodes of the one before, and up to ``larger`` larger ones, each the best depth for at least twice
    the nodes of the one before (for requests that accept more than the calibration did: a second turn that quotes the
    first); with the tuner's expected tau and cost relative to a plain step, the cost as the check measured it
    (:func:`cost_scale`)."""
    # trees expected to accept something
    useful = [r for r in choice.get("candidates") or [] if r["total_tokens"] > 0 and r["depth"] > 0 and r["tau"] > 1]
    best: dict[int, dict] = {}  # total_tokens -> the row of the best depth for it
    for row in useful:
        if row["speedup"] > best.get(row["total_tokens"], {"speedup": 0})["speedup"]:
            best[row["total_tokens"]] = row
    if not best:
        return []
    chosen = (choice["depth"], choice["total_tokens"])
    first = next((r for r in useful if (r["depth"], r["total_tokens"]) == chosen), None)
    if first is None:
        estimate = choice.get("best_estimate") or {}
        first = best.get(estimate.get("total_tokens"), max(best.values(), key=lambda r: r["speedup"]))
    rows = [first]
    while len(rows) < count:
        smaller = [total for total in best if total <= rows[-1]["total_tokens"] // 2]
        if not smaller:
            break
        rows.append(best[max(smaller)])
    top = first["total_tokens"]
    for _ in range(larger):
        bigger = [total for total in best if total >= 2 * top]
        if not bigger:
            break
        top = min(bigger)
        rows.append(best[top])
    scale = cost_scale(choice)
    return [Shape(r["depth"], r["total_tokens"], r["tau"], scale * r["tau"] / r["speedup"], max(r["depth"], lookup) + 1,
                  _nodes(r)) for r in rows]


def pass_cost(choice: dict) -> dict[int, float] | None:
    """A batch tuning record's forward-cost curve in plain steps: nodes per row -> a pass's seconds over a one-token
    pass's (None where the record measured none)."""
    costs = {int(n): s for n, s in (choice.get("forward_cost_s") or {}).items()}
    if costs.get(1, 0) <= 0:
        return None
    return {n: s / costs[1] for n, s in costs.items()}


def cost_scale(choice: dict) -> float:
    """How much dearer the check measured a tree cycle than the forward-cost curve estimated: the median over the
    head trees it timed of expected speedup / measured speedup (1 without a check). The curve times bare target
    forwards; a generation also pays the loop, the kernels' switches and a busy machine's share (on the Intel Xeon
    under load: 1.19-1.30x in greedy decoding, ``benchmarks/results/adaptive/README.md``)."""
    rows = {(r["depth"], r["total_tokens"]): r for r in choice.get("candidates") or []}
    ratios = []
    for key, measured in (choice.get("measured_speedup_over_plain") or {}).items():
        depth, total = (int(x) for x in key.split("x"))
        if total > 0 and (depth, total) in rows and measured > 0:
            ratios.append(rows[depth, total]["speedup"] / measured)
    return statistics.median(ratios) if ratios else 1.0


def tuning_record(gen, temperature: float) -> dict | None:
    """This machine's record of the tree tuned for ``gen`` at ``temperature``'s band (its reason and measurements),
    None if there is none."""
    return read_cached(_record_path(gen, temperature_band(temperature)), "tuning record", checked_choice,
                       "the next generation at this temperature tunes again")


def checked_choice(choice: dict) -> dict:
    """A tuning record whose tree the generator can use (ValueError naming the field otherwise): depth 0 only with no
    tree at all (the plain loop chosen over a lookup chain too)."""
    check_integer(choice, "total_tokens", 0, MAX_TOTAL)
    check_integer(choice, "depth", 0 if choice["total_tokens"] == 0 else 1, MAX_DEPTH)
    check_integer(choice, "top_k", 1)
    return choice


def describe(choice: dict) -> str:
    """A tuning record's choice in words, e.g. ``6 nodes, depth 3 + lookup 10 at T=1.0``."""
    lookup, temperature = choice.get("lookup", 0), choice.get("temperature", 0)
    tree = (choice["depth"], choice["total_tokens"])
    return ((_name(tree, lookup) if tree in (PLAIN, NO_TREE) else f"{tree[1]} nodes, depth {tree[0]}")
            + (f" + lookup {lookup}" if lookup else "") + (f" at T={temperature}" if temperature else ""))


def autotune(gen, retune: bool = False, budget_s: float | None = None,
             temperature: float = 0.0) -> tuple[int, int, int]:
    """-> (depth, top_k, total_tokens) for ``gen``'s target, head and lookup chain on this machine, for generations
    at ``temperature`` (tuned once per temperature band, then cached): :func:`tuned_choice`'s."""
    choice = tuned_choice(gen, retune, budget_s, temperature)
    return choice["depth"], choice["top_k"], choice["total_tokens"]


def tuned_choice(gen, retune: bool = False, budget_s: float | None = None, temperature: float = 0.0) -> dict:
    """The tuning record for ``gen`` at ``temperature``'s band: this machine's cached one, else measured now and
    cached. The record itself, not a later read of the cache, which another process tuning the same band may have
    rewritten since."""
    temperature = temperature_band(temperature)
    path = _record_path(gen, temperature)
    choice, tries = _cached(path, "tuning record", retune)
    if choice is not None:
        busy = f"; the machine's load decided it at all {_tries(choice)} tunings" if choice.get("unsettled") else ""
        log.info("draft tree: %s (tuned for this machine on %s%s; --retune measures again, --total-tokens N fixes "
                 "it)", describe(choice), choice.get("tuned_at"), busy)
        return choice
    log.info("tuning the draft tree for this machine and head%s (at most %.0f s, once; --total-tokens N skips it)",
             f" at T={temperature}" if temperature else "", budget_s or BUDGET_S)
    choice = tune(gen, budget_s, temperature=temperature)
    choice.update(tuned_at=time.strftime("%Y-%m-%d %H:%M"), tries=tries + 1)
    cached_in = f"cached in {path}" if write_cached(path, choice, "tuning record") else "not cached"
    log.info("draft tree: %s, chosen in %.0f s: %s (%s)", describe(choice), choice["tuning_s"],
             choice["reason"], cached_in)
    return choice


BATCH_BUDGET_S = {"forward cost": 12.0, "check": 25.0}  # seconds per phase of a batch size's tuning (at least 4 turns)
# a batch size's check alternates first turns (the calibration requests) with second turns: each request, the target's
# own greedy answer of at most ANSWER_TOKENS tokens and FOLLOW_UP, a turn that restates the first answer as chat
# applications' later turns often do. First turns alone undervalue small trees at batch 2: on an AMD EPYC in fp32 a
# 2-node tree read 1.01x on MT-Bench first turns and 1.16x on second turns, where the first-turn tuner kept no tree and
# adapting read 0.97x and 1.06x (benchmarks/results/amd-epyc-zen4/batching-fixed2*.md, batching-earned*.md)
ANSWER_TOKENS = 48
FOLLOW_UP = "Now say that again in fewer words."


def _batch_path(gen, rows: int, temperature: float):
    # v2: the check of first and second turns (records of the first-turn check, "-B<n>.json", are tuned again)
    return cache_dir() / "autotune" / f"{_key(gen, temperature)}-B{rows}-v2.json"


def autotune_batch(gen, rows: int, retune: bool = False, temperature: float = 0.0) -> tuple[int, int]:
    """-> (depth, total_tokens) of the tree for batches of ``rows`` prompts (total 0: the batched plain loop), tuned
    once per batch size, machine and temperature band (:func:`tune_batch`) and cached beside the one-prompt record,
    which it starts from (tuned first if need be)."""
    temperature = temperature_band(temperature)
    path = _batch_path(gen, rows, temperature)
    choice, tries = _cached(path, "batch tuning record", retune)
    if choice is None:
        log.info("tuning the draft tree for batches of %d on this machine (once; --total-tokens N skips it)", rows)
        choice = tune_batch(gen, rows, temperature)
        choice.update(tuned_at=time.strftime("%Y-%m-%d %H:%M"), tries=tries + 1)
        write_cached(path, choice, "batch tuning record")
        log.info("draft tree for batches of %d: %s", rows, choice["reason"])
    return choice["depth"], choice["total_tokens"]


def batch_tuning_record(gen, rows: int, temperature: float = 0.0) -> dict | None:
    """This machine's record of the tree tuned for batches of ``rows`` at ``temperature``'s band, None if none."""
    return read_cached(_batch_path(gen, rows, temperature_band(temperature)), "batch tuning record", checked_choice,
                       "the next batch of this size tunes again")


@torch.inference_mode()
def forward_cost_rows(gen, rows: int, sizes: list[int], context: int = 128, repeats: int = 5,
                      deadline: float | None = None, most: float | None = None) -> dict[int, float]:
    """:func:`forward_cost` of a batch: median seconds of one target pass over n new tokens in each of ``rows`` rows
    after ``context`` cached ones, sizes interleaved. ``most``: sizes are measured in increasing order and stop after
    the first that costs more than this many one-token passes (larger trees cannot pay there)."""
    ids = torch.randint(0, gen.target.config.vocab_size, (rows, context + max(sizes)), device=gen.device)
    cache = RowsCache(gen.num_layers, context + max(sizes))
    cache.lengths = [0] * rows
    positions = torch.arange(context + max(sizes), device=gen.device).expand(rows, -1)
    causal = torch.ones(context, context, dtype=torch.bool, device=gen.device).tril()
    gen.backend.forward_rows(ids[:, :context], positions[:, :context], causal[None], cache)
    cache.lengths = [context] * rows
    cache.crop_to_rows()

    def forward(n: int) -> float:
        mask = torch.ones(n, n, dtype=torch.bool, device=gen.device).tril()
        _sync(gen.device)
        t0 = time.perf_counter()
        gen.backend.forward_rows(ids[:, context : context + n], positions[:, context : context + n], mask[None],
                                 cache)
        _sync(gen.device)
        cache.crop_to_rows()
        return time.perf_counter() - t0

    times: dict[int, list[float]] = {}
    for r in range(repeats):
        if r and deadline is not None and time.perf_counter() > deadline:
            break
        for n in sorted(sizes):
            times.setdefault(n, []).append(forward(n))
            if r == 0 and most is not None and n > 1 and times[n][0] > most * times[1][0]:
                sizes = [m for m in sizes if m <= n]
                break
    return {n: statistics.median(t) for n, t in times.items()}


def _second_turns(gen, firsts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The calibration requests' second turns (see :data:`FOLLOW_UP`): each of ``firsts``, the target's greedy answer
    to it (the batched plain loop) and the follow-up."""
    answers = decode_rows(gen.backend, None, firsts, [ANSWER_TOKENS] * len(firsts), SamplingConfig(),
                          gen.eos_ids(None), None, GenerationStats())
    seconds = []
    for prompt, answer in zip(CALIBRATION, answers, strict=True):
        text = gen.tokenizer.decode(answer, skip_special_tokens=True)
        try:
            seconds.append(gen.encode([{"role": "user", "content": prompt}, {"role": "assistant", "content": text},
                                       {"role": "user", "content": FOLLOW_UP}]))
        except TemplateError:  # a base model without a chat template
            seconds.append(gen.encode(f"{prompt}\n{text}\n\n{FOLLOW_UP}\n"))
    return seconds


def _check_prompts(gen) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """-> (first turns, second turns) a batch size's check generates."""
    firsts = _calibration_prompts(gen)
    return firsts, _second_turns(gen, firsts)


def _rows_seconds_per_token(gen, prompts: list[torch.Tensor], tree: tuple[int, int], max_new_tokens: int,
                            temperature: float, seed: int) -> float:
    depth, total = tree
    drafter = None
    if total:
        longest = max(p.shape[0] for p in prompts) + max_new_tokens
        drafter = batch_drafter(gen.draft, depth, gen.top_k, total, len(prompts), longest, gen.lookup,
                                gen.lookup_ngrams, trim=not gen.static_shapes)
    sampling, generator = calibration_sampling(gen, temperature, seed)
    stats = GenerationStats()
    decode_rows(gen.backend, drafter, prompts, [max_new_tokens] * len(prompts), sampling, gen.eos_ids(None),
                generator, stats)
    return (stats.wall_s - stats.prefill_s) / max(stats.new_tokens - len(prompts), 1)  # the decoding after prefill


def _nodes(row: dict) -> float:
    """Nodes a cycle of a one-prompt record's tree verifies per row (a lookup chain's included; older records: the
    tree's nodes and the root)."""
    return row.get("nodes", row["total_tokens"] + 1)


def tune_batch(gen, rows: int, temperature: float = 0.0) -> dict:
    """Choose the tree for batches of ``rows``: the one-prompt record's expected acceptance of every tree
    (:func:`tune`'s table; acceptance is each row's own) against the forward-cost curve measured at this batch
    size and the head's batched cost per level; then the best estimate, the best with more nodes, the best trees of
    at most a half and a quarter of its nodes and the batched plain loop generate batches of first and of second
    turns (:func:`_check_prompts`, cycled to ``rows``; fewer tokens per row in larger batches, timed after the
    prefill), alternately. A tree is chosen only if the mean of its median paired speedups over the plain loop on the
    two kinds beats 1 by more than their noise and :data:`MIN_GAIN`, and it loses on neither kind by more than its
    noise and :data:`MIN_GAIN`; of those, the best mean wins."""
    record = tuning_record(gen, temperature) or {}
    table = [r for r in record.get("candidates") or [] if r["total_tokens"] > 0 and r["depth"] > 0]
    started = time.perf_counter()
    choice: dict = {"rows": rows, "top_k": gen.top_k, "temperature": temperature, "lookup": gen.lookup}
    estimates: list[dict] = []
    if table:
        most = max(r["tau"] for r in table)
        sizes = sorted({1} | {round(_nodes(r)) for r in table})
        costs = forward_cost_rows(gen, rows, sizes, most=most,
                                  deadline=started + BATCH_BUDGET_S["forward cost"])
        running = 0.0
        for n in sorted(costs):
            running = costs[n] = max(costs[n], running)
        level = draft_level_rows(gen, rows)
        overhead = record.get("cycle_overhead_s", 0.0)
        for r in table:
            if _nodes(r) <= max(costs):
                cost = interpolate(costs, _nodes(r)) + r["depth"] * level + overhead
                estimates.append(r | {"speedup": r["tau"] * costs[1] / cost})
        choice.update(forward_cost_s=costs, draft_level_s=level)
    contenders = [PLAIN]
    if estimates:
        best = max(estimates, key=lambda r: r["speedup"])
        pick = (best["depth"], best["total_tokens"])
        contenders.append(pick)
        larger = [r for r in estimates if r["total_tokens"] > pick[1]]
        if larger:  # estimates of neighbouring trees lie within their noise: the next larger one is timed too
            runner = max(larger, key=lambda r: r["speedup"])
            contenders.append((runner["depth"], runner["total_tokens"]))
        half = [r for r in estimates if r["total_tokens"] <= pick[1] // 2]
        while len(contenders) < 5 and half:  # the best estimate, then the best with at most half the nodes, twice
            smaller = max(half, key=lambda r: r["speedup"])
            contenders.append((smaller["depth"], smaller["total_tokens"]))
            half = [r for r in estimates if r["total_tokens"] <= smaller["total_tokens"] // 2]
        choice["best_estimate"] = {"depth": pick[0], "total_tokens": pick[1], "speedup": best["speedup"]}
    elif not table:
        contenders.append(DEFAULT_TREE)
    contenders = list(dict.fromkeys(contenders))
    kinds = dict(zip(("first", "second"), _check_prompts(gen), strict=True))
    times = {kind: {tree: [] for tree in contenders} for kind in kinds}  # kind -> tree -> seconds per token
    deadline = time.perf_counter() + BATCH_BUDGET_S["check"]
    for turn in itertools.count():
        kind = "first" if turn % 2 == 0 else "second"
        pool = kinds[kind]
        batch = [pool[(turn // 2 + i) % len(pool)] for i in range(rows)]
        for tree in contenders:
            times[kind][tree].append(_rows_seconds_per_token(gen, batch, tree, max(8, 2 * CHECK_TOKENS // rows),
                                                             temperature, turn))
        if turn % 2 and (turn + 1 >= CHECK_TURNS or (turn + 1 >= MIN_TURNS and time.perf_counter() > deadline)):
            break
    by_kind = {tree: {kind: paired_speedup(times[kind][PLAIN], times[kind][tree]) for kind in kinds}
               for tree in contenders if tree != PLAIN}
    paired = {tree: (statistics.fmean(g for g, _ in k.values()), math.hypot(*(n for _, n in k.values())) / len(k))
              for tree, k in by_kind.items()}  # the mean over the kinds and its noise
    paying = [tree for tree, (gain, noise) in paired.items() if gain > 1 + MIN_GAIN + noise
              and all(g >= 1 - MIN_GAIN - n for g, n in by_kind[tree].values())]
    winner = max(paying, key=lambda tree: paired[tree][0]) if paying else PLAIN
    against = ", ".join(f"{_name(t)} {gain:.2f}x ± {noise:.2f} (first turns {by_kind[t]['first'][0]:.2f}x, second "
                        f"{by_kind[t]['second'][0]:.2f}x)" for t, (gain, noise) in paired.items()) or "none"
    reason = (f"{_name(winner)}: measured fastest at batch {rows}" if winner != PLAIN else
              f"the batched plain loop: no tree beat it by more than the noise at batch {rows}") + (
              f" (median paired speedups over the plain loop, mean of first and second turns: {against})")
    measured = {tree: statistics.median(times["first"][tree] + times["second"][tree]) for tree in contenders}
    if winner == PLAIN and _within_noise(paired):
        choice["unsettled"] = "a tree measured faster than the batched plain loop, within the noise"
    choice.update(depth=winner[0], total_tokens=winner[1], reason=reason, candidates=estimates,
                  measured_s_per_token={f"{d}x{n}": t for (d, n), t in measured.items()},
                  # on first turns, the calibration requests' kind, which the estimates (and cost_scale) are priced on
                  measured_speedup_over_plain={f"{d}x{n}": k["first"][0] for (d, n), k in by_kind.items()},
                  measured_by_turn={f"{d}x{n}": {kind: g for kind, (g, _) in k.items()}
                                    for (d, n), k in by_kind.items()},
                  tuning_s=time.perf_counter() - started)
    return choice


@torch.inference_mode()
def draft_level_rows(gen, rows: int, repeats: int = 3) -> float:
    """Median seconds per level of the head drafting trees for ``rows`` rows at once (:data:`MAX_DEPTH` levels)."""
    context = 64
    drafter = BatchHeadDrafter(gen.draft, MAX_DEPTH, gen.top_k, MAX_TOTAL, rows, context + 1)
    layers = gen.draft.config.feature_layers
    width = gen.draft.config.hidden_size * (len(layers) if layers else 1)  # fused-feature heads read three layers
    prompts = [torch.randint(0, gen.target.config.vocab_size, (context,), device=gen.device) for _ in range(rows)]
    hidden = [torch.zeros(context, width, device=gen.device) for _ in range(rows)]
    roots = torch.zeros(rows, dtype=torch.long, device=gen.device)
    drafter.start(prompts, hidden, roots)
    drafter.propose(roots)  # the head reads the prompts at the first tree: that one is not timed
    times = []
    for _ in range(repeats):
        _sync(gen.device)
        t0 = time.perf_counter()
        drafter.propose(roots)
        _sync(gen.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / MAX_DEPTH


CALIBRATION_TOKENS = 64
MAX_GAMMA = 8


def _tuning_key(gen, temperature: float) -> str:
    lm = gen.draft.model
    probe = [p.detach().float().flatten()[:4096].cpu() for p in list(lm.parameters())[:8]]
    parts = [target_fingerprint(gen.target.config), str(gen.backend.lm_head.weight.dtype), str(gen.device),
             cpu_name(), str(torch.get_num_threads()), str(gen.weight_major.max_rows),
             gen.weight_major.describe(), str(lm.num_parameters()),
             str(None if gen.draft.vocab is None else len(gen.draft.vocab)), f"T={temperature}",
             hashlib.sha256(torch.cat(probe).numpy().tobytes()).hexdigest()[:16]]
    return "draft-lm-" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


@torch.inference_mode()
def draft_step_cost(draft: DraftLM, context: int = 256, repeats: int = 9) -> float:
    """Median seconds of one draft step (one token after ``context`` cached ones)."""
    cache = BufferCache(draft.num_layers, context + repeats)
    ids = torch.randint(0, draft.target_width, (context + repeats,), device=draft.device)
    draft.forward(ids[:context], torch.arange(context, device=draft.device), cache)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        draft.forward(ids[context + i : context + i + 1], torch.tensor([context + i], device=draft.device), cache)
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2]


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens per cycle of a chain of γ at per-token acceptance rate α: ``(1 − α^{γ+1}) / (1 − α)``."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def measured_alpha(hist: dict[int, int], gamma: int) -> float:
    """Per-token acceptance rate from a histogram of tokens emitted per cycle with chains of γ: accepted drafted
    tokens / drafted tokens the target judged (a chain is judged up to its first rejection)."""
    accepted = sum((count - 1) * n for count, n in hist.items())
    rejected = sum(n for count, n in hist.items() if count - 1 < gamma)
    return accepted / max(accepted + rejected, 1)


def _checked_gamma(record: dict) -> dict:
    check_integer(record, "gamma", 1)
    return record


def tune_gamma(gen, max_gamma: int = MAX_GAMMA, temperature: float = 0.0, retune: bool = False) -> dict:
    """A standalone draft LM's γ with the best expected speedup ``τ(γ)·t(1) / (γ·draft + t(γ+1))`` on this machine for
    generations at ``temperature``: the target's forward-cost curve t(n), the draft's step cost, and α measured on
    calibration prompts at the temperature's band (:func:`temperature_band`; sampled with fixed seeds), cached per
    machine and band; ``retune`` measures again."""
    temperature = temperature_band(temperature)
    path = cache_dir() / "autotune" / f"{_tuning_key(gen, temperature)}.json"
    cached = None if retune else read_cached(path, "tuning record", _checked_gamma, "tuning again")
    if cached is not None:
        return cached
    log.info("tuning the draft LM's chain length for this machine%s (once; cached in %s)",
             f" at T={temperature}" if temperature else "", path)
    costs = forward_cost(gen, list(range(1, max_gamma + 2)))
    step = draft_step_cost(gen.draft)
    hist: dict[int, int] = {}
    for seed, ids in enumerate(_calibration_prompts(gen)):
        stats = GenerationStats()
        sampling, generator = calibration_sampling(gen, temperature, seed)
        capacity = ids.shape[0] + CALIBRATION_TOKENS
        cache = BufferCache(gen.num_layers, capacity + max_gamma + 1)
        drafter = DraftLMDrafter(gen.draft, max_gamma, capacity)
        for _ in decode(gen.backend, drafter, ids, CALIBRATION_TOKENS, sampling, gen.eos_ids(None), generator, stats,
                        cache):
            pass
        for count, n in stats.accepted_hist.items():
            hist[count] = hist.get(count, 0) + n
    # cycles cut short by EOS or the budget emit fewer tokens without a rejection; they are few and count as one
    alpha = measured_alpha(hist, max_gamma)
    table = [{"gamma": g, "tau": expected_tokens(alpha, g),
              "speedup": expected_tokens(alpha, g) * costs[1] / (g * step + costs[g + 1])}
             for g in range(1, max_gamma + 1)]
    best = max(table, key=lambda row: row["speedup"])
    choice = {"gamma": best["gamma"], "temperature": temperature, "alpha": alpha, "expected_tau": best["tau"],
              "expected_speedup_vs_plain_forward": best["speedup"], "draft_step_s": step,
              "forward_cost_s": costs, "candidates": table}
    write_cached(path, choice, "tuning record")
    log.info("draft LM: gamma %d%s (alpha %.2f, expected tau %.2f)", best["gamma"],
             f" at T={temperature}" if temperature else "", alpha, best["tau"])
    return choice
