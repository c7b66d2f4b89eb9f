"""Where the time of one verification forward goes: an operator profile of the target over n new tokens.

    python -m benchmarks.verify_profile                  # embedded target, fp32, n = 1, 4 and 25 new tokens

One target forward over n new tokens after 256 cached ones, exactly as verification runs it (the generator's
``backend.forward``, with the CPU's weight-major small matmuls when they apply), is timed without the profiler (all n
interleaved, median, before any profiling) and then profiled with ``torch.profiler``. The operators' self times are
grouped into matrix products, attention, copies and views, and elementwise work (norms, rotary embedding,
activations); what the operators do not account for is Python and dispatch between them (plus the profiler's own
overhead). The matrix products' time over the bytes of weights they read gives the memory bandwidth they reach.
Writes ``benchmarks/results/verify-profile.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from griffin.cli import run_cli
from griffin.constants import EMBEDDED_TARGET

RESULTS = Path("benchmarks/results")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.verify_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--tokens", default="1,4,25", help="comma-separated numbers of new tokens per forward")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    try:
        args.tokens = [int(n) for n in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    if min(args.tokens) < 1 or args.repeats < 1:
        p.error("--tokens and --repeats must be at least 1")
    return args


if __name__ == "__main__":  # --help and usage errors answer here, before torch and transformers load
    parse_args()

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from griffin import DraftConfig, DraftModel, SpecGenerator
from griffin.autotune import cached_context_forward, forward_cost
from griffin.report import command_line, machine_info, machine_text, markdown_table, write_benchmark
from griffin.target import load_target

MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
          "mkldnn::_linear_pointwise"}  # the last: the oneDNN kernel over a packed weight (griffin.kernels)
COPIES = {"aten::copy_", "aten::cat", "aten::index_copy_", "aten::clone", "aten::contiguous", "aten::empty",
          "aten::empty_like", "aten::empty_strided", "aten::zeros", "aten::to", "aten::_to_copy", "aten::slice",
          "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::expand", "aten::transpose", "aten::t",
          "aten::as_strided", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::alias",
          "aten::detach", "aten::fill_", "aten::masked_fill_", "aten::resolve_conj", "aten::resolve_neg",
          "aten::lift_fresh", "aten::narrow", "aten::split", "aten::chunk", "aten::flatten"}
GROUPS = ["matrix products", "attention", "copies and views", "elementwise (norms, rotary, activations)"]


def group_of(name: str) -> str:
    if name in MATMUL:
        return GROUPS[0]
    if "scaled_dot_product" in name or "attention" in name:
        return GROUPS[1]
    if name in COPIES:
        return GROUPS[2]
    return GROUPS[3]


def profile_forward(forward: Callable[[int], None], n: int, repeats: int) -> dict:
    """The profiled per-forward time of ``forward(n)``, by operator group."""
    for _ in range(3):
        forward(n)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(repeats):
            forward(n)
        profiled = (time.perf_counter() - t0) / repeats
    groups = dict.fromkeys(GROUPS, 0.0)
    ops = 0
    top: dict[str, float] = {}
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6 / repeats
        groups[group_of(event.key)] += seconds
        top[event.key] = seconds
        ops += event.count
    return {"profiled_s": profiled, "groups_s": groups,
            "unattributed_s": max(profiled - sum(groups.values()), 0.0), "ops_per_forward": ops / repeats,
            "top_ops_s": dict(sorted(top.items(), key=lambda kv: -kv[1])[:8])}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer = load_target(args.target, dtype=args.dtype)
    head = DraftModel(DraftConfig.from_target(model.config, arch="griffin"))  # only the target forward is profiled
    gen = SpecGenerator(model, tokenizer, head)
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))
    forward_cost(gen, args.tokens, repeats=1)  # warm-up
    walls = forward_cost(gen, args.tokens, repeats=args.repeats)  # all sizes interleaved, before any profiling
    forward = cached_context_forward(gen, 256, max(args.tokens))
    runs = {n: {"wall_s": walls[n], **profile_forward(forward, n, args.repeats)} for n in args.tokens}
    result = {"target": args.target, "dtype": args.dtype, "context": 256, "repeats": args.repeats,
              "weight_major_max_rows": gen.weight_major.max_rows, "linear_weight_bytes": weight_bytes,
              "runs": runs, "machine": machine_info(), "command": command_line("benchmarks.verify_profile")}
    write_benchmark(args.out_dir, "verify-profile", result, table(result))
    return 0


def table(r: dict) -> str:
    ms = 1000
    runs = r["runs"]
    headers = ["ms per forward", *(f"n={n}" for n in runs)]
    rows = [["wall time, not profiled", *(run["wall_s"] * ms for run in runs.values())],
            ["wall time, profiled", *(run["profiled_s"] * ms for run in runs.values())]]
    for group in GROUPS:
        rows.append([group, *(run["groups_s"][group] * ms for run in runs.values())])
    rows.append(["not in any operator (Python, dispatch, profiler)", *(run["unattributed_s"] * ms
                                                                        for run in runs.values())])
    rows.append(["operators per forward", *(run["ops_per_forward"] for run in runs.values())])
    rows.append(["matrix products' weight bandwidth, GB/s", *(r["linear_weight_bytes"] / run["groups_s"][GROUPS[0]]
                                                               / 1e9 for run in runs.values())])
    top = {n: ", ".join(f"`{k}` {v * ms:.1f}" for k, v in run["top_ops_s"].items()) for n, run in runs.items()}
    m = r["machine"]
    return (f"# Profile of one verification forward\n\nTarget {r['target']} ({r['dtype']}), n new tokens after "
            f"{r['context']} cached ones, {r['repeats']} forwards per n; linear layers weight-major for 2 to "
            f"{r['weight_major_max_rows']} rows (0: off), as verification computes them. The matrix products read "
            f"{r['linear_weight_bytes'] / 1e6:.0f} MB of linear-layer weights per forward.\n\n"
            f"{markdown_table(headers, rows)}\nSlowest operators (self time, ms per forward):\n\n"
            + "".join(f"- n={n}: {text}\n" for n, text in top.items())
            + f"\nCommand: `{r['command']}`\n\nMachine: {machine_text(m)}.\n")


if __name__ == "__main__":
    sys.exit(run_cli(main, (RuntimeError,)))
