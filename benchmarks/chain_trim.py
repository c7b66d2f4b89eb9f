"""A prompt-lookup chain at a static size against one cut to its real tokens, on the CPU.

    OMP_NUM_THREADS=1 python -m benchmarks.chain_trim      # MT-Bench, 2 questions per category, both turns

A static chain verifies all of its ``--lookup`` nodes every cycle, padding included, which a GPU needs (no size is
read back before the pass). On the CPU a pass costs more with every node, and reading the chain's size costs no sync,
so the generator cuts the chain to the tokens it really found (``SpecGenerator.static_shapes`` False, the CPU
default). This study measures what that gains, and which n-gram sizes a trimmed chain should match with: per prompt
(MT-Bench's first questions of each category, the second turn after the plain loop's first answer) the plain loop
and the fixed default tree with the chain in each variant take turns on the embedded target in fp32, greedy. Speedups
are the mean over prompts of tokens/s over the plain loop's on the same prompt, with the standard error of the paired
difference against the static chain. Every variant must write the plain loop's tokens. Writes ``<out>.json``, ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks.paired import study_parser, take_turns, timed
from griffin.cli import run_cli
from griffin.report import command_line, machine_info, machine_text, markdown_table, write_benchmark

# name -> (static shapes, the chain's n-gram sizes)
VARIANTS = {"static, n-grams 3/2/1": (True, (3, 2, 1)), "trimmed, n-grams 3/2/1": (False, (3, 2, 1)),
            "trimmed, n-grams 3/2": (False, (3, 2)), "trimmed, n-grams 3": (False, (3,))}
BASE = "static, n-grams 3/2/1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = study_parser("python -m benchmarks.chain_trim", __doc__,
                        "benchmarks/results/chain-trim/chain-trim").parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from griffin import SpecGenerator

    torch.manual_seed(0)
    plain = SpecGenerator.from_pretrained(args.target, total_tokens=0, adapt=False)
    tree = SpecGenerator.from_pretrained(args.target, total_tokens=args.total_tokens, depth=args.depth,
                                         lookup=args.lookup, adapt=False)
    if not tree.device.type == "cpu":
        raise ValueError("this study compares chain sizes on the CPU; a GPU keeps static shapes")

    def generate(name: str, ids: torch.Tensor) -> tuple[float, object]:
        if name == "plain":
            return timed(plain, ids, args.max_new_tokens)
        tree.static_shapes, tree.lookup_ngrams = VARIANTS[name]
        return timed(tree, ids, args.max_new_tokens)

    warm = plain.encode([{"role": "user", "content": "Hello"}])
    for name in ("plain", *VARIANTS):  # first calls' one-time costs untimed
        generate(name, warm)
    rows = take_turns(generate, ["plain", *VARIANTS], plain.encode, args.per_category)

    def speedups(name: str) -> list[float]:
        return [r[name]["tokens_per_s"] / r["plain"]["tokens_per_s"] for r in rows]

    summary = {}
    for name in VARIANTS:
        ours, base = speedups(name), speedups(BASE)
        diffs = [a - b for a, b in zip(ours, base, strict=True)]
        summary[name] = {"speedup": statistics.mean(ours), "tau": statistics.mean(r[name]["tau"] for r in rows),
                         "minus_static": statistics.mean(diffs),
                         "minus_static_se": statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0}
    result = {"target": args.target, "max_new_tokens": args.max_new_tokens,
              "tree": f"{args.total_tokens}x{args.depth}", "lookup": args.lookup, "prompts": len(rows),
              "summary": summary, "per_prompt": rows, "machine": machine_info(),
              "command": command_line("benchmarks.chain_trim", args.argv)}
    table = [[name, f"{s['speedup']:.3f}x", f"{s['tau']:.2f}",
              "-" if name == BASE else f"{s['minus_static']:+.3f} ± {s['minus_static_se']:.3f}"]
             for name, s in summary.items()]
    text = (f"# A trimmed prompt-lookup chain · {args.target} · MT-Bench T=0\n\n"
            f"{args.per_category} questions per category, both turns ({len(rows)} prompts), {args.max_new_tokens} new "
            f"tokens, fp32, one thread. Tree {args.total_tokens} nodes, depth {args.depth}, with a chain of "
            f"{args.lookup} tokens, no adaptation; all variants and the plain loop take turns on every prompt and "
            "write the same tokens. Speedup: mean over prompts of tokens/s over the plain loop's; the last column is "
            "the mean paired difference from the static chain with its standard error.\n\n"
            + markdown_table(["chain", "speedup over the plain loop", "τ", "minus static"], table)
            + f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(result['machine'])}.\n")
    out = Path(args.out)
    write_benchmark(out.parent, out.name, result, text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
