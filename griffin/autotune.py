"""``total_tokens="auto"``: choose the tree size and depth that maximise expected speedup on this machine.

1. The target's forward-cost curve ``t(n)`` (n tokens on top of a cached context) and the head's cost per drafting
   level are measured.
2. A few calibration prompts (generic requests, not evaluation questions) are generated greedily with a large tree;
   for every cycle the draft-score rank and depth of each node on the accepted path are recorded. A smaller tree of
   ``N`` nodes and depth ``d`` is the ``N`` best-ranked nodes of depth <= d of the same candidates, so the tokens it
   would have accepted follow from those ranks.
3. Expected speedup = ``tau(N, d) * t(1) / (t(N+1) + draft(d))``; the best (N, d) is cached per machine, target,
   dtype and head under ``<griffin cache>/autotune/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from collections.abc import Callable

import torch

from .io import atomic_write_json
from .kv_cache import BufferCache
from .target import cache_dir, target_fingerprint

log = logging.getLogger(__name__)

CALIBRATION = [
    "Explain how a bicycle works.",
    "Write a short story about a lighthouse keeper.",
    "Give three tips for staying focused while studying.",
    "What are the health benefits of drinking water?",
]
MAX_DEPTH, MAX_TOTAL = 8, 64
TOTALS = list(range(1, 17)) + list(range(18, MAX_TOTAL + 1, 2))  # every small tree; larger ones in steps of 2


def _key(gen) -> str:
    weight = gen.draft.fusion.fc.weight.detach().float().cpu().numpy().tobytes()
    parts = [target_fingerprint(gen.target.config), str(gen.lm_head.weight.dtype), str(gen.device),
             platform.processor() or platform.machine(), str(torch.get_num_threads()), str(gen.top_k),
             str(gen.weight_major.max_rows), hashlib.sha256(weight).hexdigest()[:16]]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


@torch.inference_mode()
def forward_cost(gen, sizes: list[int], context: int = 256, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one target forward over n new tokens after ``context`` cached ones."""
    forward = cached_context_forward(gen, context, max(sizes))
    sync = torch.cuda.synchronize if gen.device.type == "cuda" else lambda: None
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:  # interleaved, so that machine noise spreads over all sizes
            sync()
            t0 = time.perf_counter()
            forward(n)
            sync()
            times[n].append(time.perf_counter() - t0)
    return {n: sorted(t)[len(t) // 2] for n, t in times.items()}


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


def expected_tau(trace: list, total: int, depth: int) -> float:
    """Mean tokens per cycle had the trees been cut to ``total`` nodes of depth <= ``depth``."""
    accepted = []
    for tree, path in trace:
        depths, ranks = tree.depths, tree.ranks()
        allowed = depths <= depth
        order = torch.argsort(torch.where(allowed, ranks, ranks.max() + 1))
        kept = torch.zeros_like(allowed)
        kept[order[: total + 1]] = True  # the root and the `total` best allowed nodes
        kept &= allowed
        inside = kept[path[1:]]
        accepted.append(int(inside.int().cumprod(0).sum()) + 1)
    return sum(accepted) / len(accepted)


def autotune(gen, max_new_tokens: int = 96, retune: bool = False) -> tuple[int, int, int]:
    """-> (depth, top_k, total_tokens) for ``gen``'s target and head on this machine (cached)."""
    path = cache_dir() / "autotune" / f"{_key(gen)}.json"
    if path.is_file() and not retune:
        choice = json.loads(path.read_text())
        return choice["depth"], choice["top_k"], choice["total_tokens"]
    log.info("tuning the tree size for this machine and head (once; cached in %s)", path)
    costs = forward_cost(gen, [1] + [total + 1 for total in TOTALS])  # the root and `total` drafted nodes
    saved = gen.depth, gen.total_tokens, gen.timing
    gen.depth, gen.total_tokens, gen.timing = MAX_DEPTH, MAX_TOTAL, True  # the draft time per cycle is needed
    trace: list = []
    draft_time = cycles = 0
    from .generator import GenerationStats
    from .sampling import SamplingConfig

    try:
        for prompt in CALIBRATION:
            ids = gen.encode([{"role": "user", "content": prompt}])
            stats = GenerationStats()
            for _ in gen._steps(ids, max_new_tokens, SamplingConfig(), gen.eos_ids(None), None, stats, trace=trace):
                pass
            draft_time += stats.draft_s
            cycles += stats.cycles
    finally:
        gen.depth, gen.total_tokens, gen.timing = saved
    per_level = draft_time / max(cycles, 1) / MAX_DEPTH  # the update pass plus depth-1 expansions per cycle
    best = None
    table = []
    for depth in range(1, MAX_DEPTH + 1):
        for total in TOTALS:
            tau = expected_tau(trace, total, depth)
            speedup = tau * costs[1] / (costs[total + 1] + depth * per_level)
            table.append({"depth": depth, "total_tokens": total, "tau": tau, "speedup": speedup})
            if best is None or speedup > best["speedup"]:
                best = table[-1]
    choice = {"depth": best["depth"], "top_k": gen.top_k, "total_tokens": best["total_tokens"],
              "expected_tau": best["tau"], "expected_speedup_vs_plain_forward": best["speedup"],
              "forward_cost_s": costs, "draft_level_s": per_level, "cycles": len(trace), "candidates": table}
    atomic_write_json(path, choice)
    log.info("tree: depth %d, %d nodes (expected tau %.2f)", choice["depth"], choice["total_tokens"], best["tau"])
    return choice["depth"], choice["top_k"], choice["total_tokens"]
