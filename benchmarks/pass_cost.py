"""Why speculation stops paying as the batch grows: the target's pass cost against tokens per row, per batch size.

    OMP_NUM_THREADS=1 python -m benchmarks.pass_cost
    OMP_NUM_THREADS=1 python -m benchmarks.pass_cost --dtypes bf16 --batch-sizes 1,2 --tokens 1,4,8

A tree of n nodes per row makes every cycle a pass over n+1 tokens in each of B rows; it pays only where that pass
costs little more than the one-token pass of plain decoding (which batching already shares over B rows). For each
dtype and batch size this times one target pass over ``--tokens`` new tokens per row after 128 cached ones (the
median of ``--repeats``, sizes interleaved; :func:`griffin.autotune.forward_cost_rows`, what the batch tuner uses)
and one level of the head drafting B trees. Writes ``<out>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.batching import dtypes, sizes
from griffin.cli import positive_int, run_cli
from griffin.constants import EMBEDDED_TARGET
from griffin.report import command_line, machine_info, machine_text, markdown_table, write_benchmark


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pass_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--draft", default=None, help="head folder (default: the head shipped for the target)")
    p.add_argument("--batch-sizes", type=sizes, default=[1, 2, 4, 8, 16])
    p.add_argument("--tokens", type=sizes, default=[1, 2, 4, 8, 16, 32], help="new tokens per row of a pass")
    p.add_argument("--dtypes", type=dtypes, default=["fp32", "bf16"])
    p.add_argument("--repeats", type=positive_int, default=7)
    p.add_argument("--out", default="benchmarks/results/pass-cost", help="path without suffix")
    args = p.parse_args(argv)
    args.argv = argv
    return args


def measure(args: argparse.Namespace, dtype: str) -> dict:
    from griffin import SpecGenerator
    from griffin.autotune import draft_level_rows, forward_cost_rows

    gen = SpecGenerator.from_pretrained(args.target, args.draft, dtype=dtype, total_tokens=1, depth=1)
    out = {}
    for b in args.batch_sizes:
        cost = forward_cost_rows(gen, b, sorted(set(args.tokens) | {1}), repeats=args.repeats)
        out[str(b)] = {"pass_s": {str(n): s for n, s in cost.items()}, "draft_level_s": draft_level_rows(gen, b)}
        print(f"{dtype} B={b}: " + ", ".join(f"{n} tok/row {s * 1e3:.0f} ms" for n, s in cost.items()), flush=True)
    return {"dtype": dtype, "batches": out}


def markdown(result: dict) -> str:
    tokens = result["tokens"]
    lines = [f"# Target pass cost per batch size · {result['target']}\n",
             "One target pass over n new tokens in each of B rows after 128 cached ones, as a multiple of the pass "
             "over one token per row (plain decoding's step at that batch size, its ms in the second column; the "
             "third: one level of the head drafting B trees). A tree of n−1 nodes per row pays only where its pass "
             "multiple stays well under the tokens a cycle accepts per row (τ).\n"]
    for run in result["runs"]:
        rows = []
        for b, r in run["batches"].items():
            one = r["pass_s"]["1"]
            rows.append([b, f"{one * 1e3:.0f} ms", f"{r['draft_level_s'] * 1e3:.1f} ms",
                         *(f"{r['pass_s'][str(n)] / one:.2f}x" for n in tokens if n > 1)])
        lines += [f"## {run['dtype']}\n", markdown_table(
            ["B", "1 token/row", "draft level", *(f"{n} tokens/row" for n in tokens if n > 1)], rows)]
    lines += [f"Command: `{result['command']}`\n", f"Machine: {machine_text(result['machine'])}; load average "
              f"{result['machine']['load_average_1m']} when written.\n"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    result = {"target": args.target, "tokens": args.tokens, "runs": [measure(args, d) for d in args.dtypes],
              "command": command_line("benchmarks.pass_cost", args.argv), "machine": machine_info()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_benchmark(out.parent, out.name, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
