"""The greedy pick over the vocabulary: ``argmax`` against ``max(...).indices``, side by side.

    OMP_NUM_THREADS=1 python -m benchmarks.greedy_pick        # the embedded target's vocabulary, fp32 and bf16

Greedy decoding and greedy verification pick the largest logit of every row: one row per plain decode step, one row
per tree node when verifying. Both ops return the first index among equal maxima; their CPU kernels differ in speed,
most in bf16. :func:`griffin.sampling.greedy` uses the faster one. This times both on random logits of
``--vocab`` columns for each row count, taking turns in a rotated order after a warm-up, and reports the medians.
Writes ``benchmarks/results/greedy-pick.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from griffin.cli import run_cli
from griffin.report import command_line, machine_info, machine_text, markdown_table, write_benchmark

RESULTS = Path("benchmarks/results")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.greedy_pick", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=49152, help="columns per row (default: SmolLM2's vocabulary)")
    p.add_argument("--rows", default="1,8,24", help="comma-separated row counts (decode step, tree sizes)")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, of {', '.join(DTYPES)}")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    args.argv = argv
    try:
        args.rows = [int(r) for r in args.rows.split(",") if r]
        assert args.rows and min(args.rows) >= 1
    except (ValueError, AssertionError):
        p.error("--rows must list positive integers, e.g. 1,8,24")
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if not args.dtypes or any(d not in DTYPES for d in args.dtypes):
        p.error(f"--dtypes must list some of {', '.join(DTYPES)}")
    if min(args.vocab, args.rounds) < 1:
        p.error("--vocab and --rounds must be at least 1")
    return args


if __name__ == "__main__":  # --help and usage errors answer here, before torch loads
    parse_args()

import torch

from griffin.sampling import greedy

PICKS = {"argmax": lambda x: x.argmax(dim=-1), "max().indices": greedy}  # the latter: what griffin uses


def time_picks(logits: torch.Tensor, rounds: int) -> dict[str, float]:
    """Median milliseconds of each pick on ``logits`` [rows, V], taking turns after five warm-up rounds."""
    names = list(PICKS)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 5):
        for name in names[r % 2:] + names[: r % 2]:
            t0 = time.perf_counter()
            PICKS[name](logits)
            if r >= 5:
                times[name].append(1000 * (time.perf_counter() - t0))
    return {n: statistics.median(t) for n, t in times.items()}


def measure(args: argparse.Namespace) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for dtype in args.dtypes:
        for n in args.rows:
            logits = torch.randn(n, args.vocab, generator=generator).to(getattr(torch, DTYPES[dtype]))
            same = all(torch.equal(PICKS["argmax"](x), PICKS["max().indices"](x))
                       for x in (logits, logits.round()))  # rounded: many ties at the maximum
            ms = time_picks(logits, args.rounds)
            rows.append({"dtype": dtype, "rows": n, "ms": ms, "same_indices": same,
                         "speedup": ms["argmax"] / ms["max().indices"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    result = {"vocab": args.vocab, "rounds": args.rounds, "rows": rows, "machine": machine_info(),
              "command": command_line("benchmarks.greedy_pick", args.argv)}
    table = markdown_table(["dtype", "rows", "argmax ms", "max().indices ms", "argmax / max", "same indices"],
                           [[r["dtype"], r["rows"], f"{r['ms']['argmax']:.3f}", f"{r['ms']['max().indices']:.3f}",
                             f"{r['speedup']:.2f}x", r["same_indices"]] for r in rows])
    markdown = (f"# Greedy pick over {args.vocab} logits: argmax against max().indices\n\nMedian of {args.rounds} "
                "calls each, taking turns; `same indices` checks random rows and rounded rows full of ties.\n\n"
                f"{table}\nCommand: `{result['command']}`\n\nMachine: {machine_text(result['machine'])}.\n")
    write_benchmark(args.out_dir, "greedy-pick", result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, ()))
