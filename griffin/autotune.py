"""``total_tokens="auto"``: choose the tree size and depth that maximise the speedup on this machine, in seconds.

Bounded in time (``budget_s``, 30 s by default; a progress bar shows it) and robust to a busy machine:

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
3. Expected speedup over plain decoding = ``tau(N, d) * t(1) / (t(N+1+K) + d * draft_level + overhead)``.
4. Check (30 %): the best candidate and a small default tree (with the whole chain) generate the same prompt in turns;
   the fastest per token by median wins, so the choice is never worse than the default. Where the best estimate is
   under 1.15x, decoding with no tree at all (the chain alone, or plain decoding through the loop,
   :class:`griffin.drafters.NoDraft`) runs in the turns too, so a head that cannot pay for its tree (sampling with a
   weak head, a machine where wider passes cost much more) does not slow generation down. Too little calibration
   data falls back to the default tree.

**Temperature.** Sampling accepts far less than greedy decoding (on MT-Bench with the embedded target and a 10-token
lookup chain, fp32: τ 1.40 at T=1 against 2.98 at T=0, ``benchmarks/results/mt_bench-*-lookup10-T*.md``), so the best
tree differs: a tree is tuned per temperature band (:func:`temperature_band`: 0 for greedy, else the temperature
rounded to 0.1). :class:`griffin.SpecGenerator` tunes the greedy tree when it is loaded and a sampled band the first
time a generation asks for it.

The choice is cached per machine, target, dtype, head and temperature band under ``<griffin cache>/autotune/`` with
the reason for it; ``retune=True`` (``--retune`` on the commands) measures again, ``total_tokens=N`` skips the tuning.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import statistics
import time
from collections.abc import Callable, Iterator

import numpy
import torch

from .io import check_integer, read_cached, write_cached
from .kernels import cpu_name
from .kv_cache import BufferCache
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
NO_TREE = (1, 0)  # no drafted node: plain decoding through the loop (prompt lookup alone with a chain)
TRY_NO_TREE_BELOW = 1.15  # the best expected speedup under which the check also times decoding without a tree
MIN_CYCLES = 8  # fewer calibration cycles than this: too little data to trust, keep the default
BUDGET_S = 30.0
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
             str(gen.weight_major.max_rows), gen.weight_major.describe(), str(gen.lookup),
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
    gen._target_forward(ids[:context], torch.arange(context, device=gen.device), causal, cache, last_logits_only=True)

    @torch.inference_mode()
    def forward(n: int) -> None:
        mask = torch.ones(n, n, dtype=torch.bool, device=gen.device).tril()
        gen._target_forward(ids[context : context + n], torch.arange(context, context + n, device=gen.device),
                            mask, cache)
        cache.crop(context)

    return forward


def expected_tau(trace: list, total: int, depth: int, chain: int = 0) -> float:
    """Mean tokens per cycle had the trees been cut to ``total`` head nodes of depth <= ``depth``. ``chain``: the
    nodes of the prompt-lookup chain grafted onto every traced tree (its last nodes), which a cut tree keeps too.

    The chain spells the path of its own nodes and of the head's nodes above the first of them (graft hangs the chain
    below the deepest node that spells its start); those stay however the head's part is cut."""
    accepted = []
    for tree, path in trace:
        depths, ranks = tree.depths, tree.ranks()
        head = torch.arange(tree.size, device=depths.device) < tree.size - chain
        allowed = (depths <= depth) & head
        order = torch.argsort(torch.where(allowed, ranks, ranks.max() + 1))
        kept = torch.zeros_like(allowed)
        kept[order[: total + 1]] = True  # the root and the `total` best allowed nodes
        kept &= allowed
        if chain:
            real = ~head if tree.valid is None else ~head & tree.valid
            kept |= tree.ancestors[real].any(dim=0) | real  # chain nodes and every node above them
        inside = kept[path[1:]]
        accepted.append(int(inside.int().cumprod(0).sum()) + 1)
    return sum(accepted) / len(accepted)


class _Clock:
    """Wall time against the budget, shown as a progress bar in seconds."""

    def __init__(self, budget_s: float):
        from tqdm.auto import tqdm

        self.start = time.perf_counter()
        self.budget = budget_s
        self.bar = tqdm(total=round(budget_s), desc="tuning the draft tree (once)", unit="s", leave=False,
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


def _calibration_prompts(gen) -> Iterator[torch.Tensor]:
    from .chat_template import TemplateError

    for prompt in CALIBRATION:
        try:
            yield gen.encode([{"role": "user", "content": prompt}])
        except TemplateError:  # a base model without a chat template
            yield gen.encode(prompt)


def calibration_sampling(gen, temperature: float, seed: int) -> tuple:
    """-> (SamplingConfig, torch.Generator or None) of a calibration generation at ``temperature``."""
    from .sampling import SamplingConfig

    if temperature == 0:
        return SamplingConfig(), None
    return SamplingConfig(temperature), torch.Generator(device=gen.device).manual_seed(seed)


def _calibrate(gen, clock: _Clock, max_new_tokens: int, temperature: float) -> tuple[list, dict]:
    from .generator import GenerationStats

    deadline = clock.deadline("calibration")
    trace: list = []
    totals = {"draft_s": 0.0, "other_s": 0.0, "cycles": 0, "new_tokens": 0}
    saved = gen.depth, gen.total_tokens, gen.timing
    gen.depth, gen.total_tokens, gen.timing = MAX_DEPTH, MAX_TOTAL, True  # the draft time per cycle is needed
    try:
        for seed, ids in enumerate(_calibration_prompts(gen)):
            stats = GenerationStats()
            sampling, generator = calibration_sampling(gen, temperature, seed)
            for _ in gen._steps(ids, max_new_tokens, sampling, gen.eos_ids(None), generator, stats, trace=trace):
                clock.tick("calibration")
                if time.perf_counter() > deadline:
                    break
            totals["draft_s"] += stats.draft_s
            totals["other_s"] += stats.other_s
            totals["cycles"] += stats.cycles
            totals["new_tokens"] += stats.new_tokens - 1  # the prefill's token is no cycle's
            if time.perf_counter() > deadline:
                break
    finally:
        gen.depth, gen.total_tokens, gen.timing = saved
    return trace, totals


def _seconds_per_token(gen, ids: torch.Tensor, tree: tuple[int, int], max_new_tokens: int, temperature: float,
                       seed: int) -> float:
    saved = gen.depth, gen.total_tokens
    gen.depth, gen.total_tokens = tree
    try:
        _sync(gen.device)
        t0 = time.perf_counter()
        out = gen.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        _sync(gen.device)
        return (time.perf_counter() - t0) / out.stats.new_tokens
    finally:
        gen.depth, gen.total_tokens = saved


def _check(gen, clock: _Clock, trees: list[tuple[int, int]], max_new_tokens: int,
           temperature: float) -> dict[tuple[int, int], float]:
    """Median seconds per token of each of ``trees`` (depth, total_tokens), generated in turns (when sampling, all
    with the same seed in each turn)."""
    ids = next(_calibration_prompts(gen))
    deadline = clock.deadline("check")
    times: dict[tuple[int, int], list[float]] = {tree: [] for tree in trees}
    for turn in itertools.count():
        for tree in trees:
            times[tree].append(_seconds_per_token(gen, ids, tree, max_new_tokens, temperature, turn))
            clock.tick("check")
        if turn >= 4 or time.perf_counter() > deadline:
            break
    return {tree: statistics.median(t) for tree, t in times.items()}


def _name(tree: tuple[int, int]) -> str:
    return {NO_TREE: "no draft tree", DEFAULT_TREE: "the default tree"}.get(tree, f"{tree[1]} nodes, depth {tree[0]}")


def interpolate(costs: dict[int, float], n: int) -> float:
    """t(n) from the measured sizes: linear between the two nearest, the nearest end outside them."""
    sizes = sorted(costs)
    return float(numpy.interp(n, sizes, [costs[s] for s in sizes]))


def tune(gen, budget_s: float | None = None, max_new_tokens: int = 64, temperature: float = 0.0) -> dict:
    """Measure and choose for generations at ``temperature``; -> the choice with its reason and measurements (see the
    module docstring)."""
    budget_s = budget_s or BUDGET_S
    clock = _Clock(budget_s)
    was_tuning, gen._tuning = gen._tuning, True  # its generations must not start another tuning (tune_for)
    try:
        # one-time costs of the first calls: untimed
        gen.generate(next(_calibration_prompts(gen)), max_new_tokens=4, temperature=temperature, seed=0)
        trace, totals = _calibrate(gen, clock, max_new_tokens, temperature)
        cycles = totals["cycles"]
        measured_tau = (totals["new_tokens"] / cycles) if cycles else 1.0
        choice: dict = {"top_k": gen.top_k, "temperature": temperature, "calibration_cycles": cycles,
                        "calibration_tau": measured_tau, "budget_s": budget_s}
        if cycles < MIN_CYCLES:
            depth, total = DEFAULT_TREE
            reason = f"the default tree: only {cycles} calibration cycles fitted in the time (machine too busy?)"
            choice.update(depth=depth, total_tokens=total, reason=reason, tuning_s=clock.elapsed)
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
                tau = min(expected_tau(trace, total, depth, gen.lookup), measured_tau)
                speedup = tau * costs[1] / (interpolate(costs, total + 1 + gen.lookup) + depth * level + overhead)
                table.append({"depth": depth, "total_tokens": total, "tau": tau, "speedup": speedup})
        best = max(table, key=lambda row: row["speedup"])
        pick = (best["depth"], best["total_tokens"])
        # no tree: the chain alone (or nothing); no drafting, the loop's overhead stays
        tau = min(expected_tau(trace, 0, 1, gen.lookup), measured_tau) if gen.lookup else 1.0
        table.append({"depth": NO_TREE[0], "total_tokens": 0, "tau": tau,
                      "speedup": tau * costs[1] / (interpolate(costs, 1 + gen.lookup) + overhead)})
        rows = {(row["depth"], row["total_tokens"]): row for row in table}
        low = best["speedup"] < TRY_NO_TREE_BELOW  # then decoding without a tree is timed too
        contenders = list(dict.fromkeys([pick, DEFAULT_TREE, *([NO_TREE] if low else [])]))
        reason = f"expected tau {best['tau']:.2f} at {best['speedup']:.2f}x the plain decoding rate"
        measured = {}
        if len(contenders) > 1:
            measured = _check(gen, clock, contenders, 16, temperature)
            winner = min(contenders, key=measured.__getitem__)
            others = ", ".join(f"{_name(t)} {measured[t] / measured[winner]:.2f}x" for t in contenders if t != winner)
            if winner == pick:
                reason += f"; measured fastest per token (time per token against it: {others})"
            else:
                reason = (f"{_name(winner)}: measured fastest per token, the best estimate ({_name(pick)}, "
                          f"{best['speedup']:.2f}x) included (time per token against it: {others})")
            pick, best = winner, rows[winner]
        choice.update(depth=pick[0], total_tokens=pick[1], lookup=gen.lookup, reason=reason,
                      expected_tau=best["tau"], expected_speedup=best["speedup"], forward_cost_s=costs,
                      draft_level_s=level, cycle_overhead_s=overhead,
                      measured_s_per_token={f"{d}x{n}": s for (d, n), s in measured.items()},
                      candidates=table, tuning_s=clock.elapsed)
        return choice
    finally:
        gen._tuning = was_tuning
        clock.close()


def tuning_record(gen, temperature: float) -> dict | None:
    """This machine's record of the tree tuned for ``gen`` at ``temperature``'s band (its reason and measurements),
    None if there is none."""
    return read_cached(_record_path(gen, temperature_band(temperature)), "tuning record", checked_choice,
                       "the next generation at this temperature tunes again")


def checked_choice(choice: dict) -> dict:
    """A tuning record whose tree the generator can use (ValueError naming the field otherwise)."""
    check_integer(choice, "depth", 1, MAX_DEPTH)
    check_integer(choice, "top_k", 1)
    check_integer(choice, "total_tokens", 0, MAX_TOTAL)
    return choice


def _describe(choice: dict) -> str:
    lookup, temperature = choice.get("lookup", 0), choice.get("temperature", 0)
    tree = (choice["depth"], choice["total_tokens"])
    return (("no draft tree" if tree == NO_TREE else f"{tree[1]} nodes, depth {tree[0]}")
            + (f" + lookup {lookup}" if lookup else "") + (f" at T={temperature}" if temperature else ""))


def autotune(gen, retune: bool = False, budget_s: float | None = None,
             temperature: float = 0.0) -> tuple[int, int, int]:
    """-> (depth, top_k, total_tokens) for ``gen``'s target, head and lookup chain on this machine, for generations
    at ``temperature`` (tuned once per temperature band, then cached)."""
    temperature = temperature_band(temperature)
    path = _record_path(gen, temperature)
    choice = None if retune else read_cached(path, "tuning record", checked_choice, "tuning again")
    if choice is not None:
        log.info("draft tree: %s (tuned for this machine on %s; --retune measures again, --total-tokens N fixes "
                 "it)", _describe(choice), choice.get("tuned_at"))
        return choice["depth"], choice["top_k"], choice["total_tokens"]
    log.info("tuning the draft tree for this machine and head%s (at most %.0f s, once; --total-tokens N skips it)",
             f" at T={temperature}" if temperature else "", budget_s or BUDGET_S)
    choice = tune(gen, budget_s, temperature=temperature)
    choice["tuned_at"] = time.strftime("%Y-%m-%d %H:%M")
    cached_in = f"cached in {path}" if write_cached(path, choice, "tuning record") else "not cached"
    log.info("draft tree: %s, chosen in %.0f s: %s (%s)", _describe(choice), choice["tuning_s"],
             choice["reason"], cached_in)
    return choice["depth"], choice["top_k"], choice["total_tokens"]
