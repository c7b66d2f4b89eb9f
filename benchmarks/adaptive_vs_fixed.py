"""Adaptation against a fixed tree: does per-request adaptation keep what the fixed tree gains on chat traffic?

    OMP_NUM_THREADS=1 python -m benchmarks.adaptive_vs_fixed      # MT-Bench, 2 questions per category, both turns

Per prompt (MT-Bench's first questions of each category, the second turn after the plain loop's first answer), three
generators take turns on the embedded target in fp32, greedy, 128 new tokens: the plain loop (``total_tokens=0``), a
fixed tree (``--depth``/``--total-tokens``, the default tree, with the ``--lookup`` chain, no adaptation) and the
generator as users get it (the tree tuned on this machine, adapted per request, the same chain). Speedups are the
mean over prompts of tokens/s over the plain loop's on the same prompt. Besides the wall clock, a *modelled* speedup
that the machine's noise does not move: new tokens over the cycles each method ran, a tree cycle counted at the cost
the tuner's forward-cost curve gives its shape in plain steps (the tuning record of this machine), a plain step as 1.
Writes ``<out>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.paired import study_parser, take_turns, timed
from griffin.cli import run_cli
from griffin.report import command_line, machine_info, machine_text, markdown_table, write_benchmark

METHODS = ("plain", "fixed", "adaptive")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = study_parser("python -m benchmarks.adaptive_vs_fixed", __doc__, "benchmarks/results/adaptive/adaptive-vs-fixed")
    p.add_argument("--retune", action="store_true", help="measure the adaptive generator's tree again first")
    args = p.parse_args(argv)
    args.argv = argv
    return args


def shape_costs(record: dict) -> dict[str, float]:
    """Plain steps per cycle of every shape the tuner estimated (``"<nodes>x<depth>"``), from its record."""
    return {f"{r['total_tokens']}x{r['depth']}": r["tau"] / r["speedup"] for r in record.get("candidates") or []
            if r["total_tokens"] > 0 and r["speedup"] > 0}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from griffin import SpecGenerator

    torch.manual_seed(0)
    gens = {"plain": SpecGenerator.from_pretrained(args.target, total_tokens=0, adapt=False),
            "fixed": SpecGenerator.from_pretrained(args.target, total_tokens=args.total_tokens, depth=args.depth,
                                                   lookup=args.lookup, adapt=False),
            "adaptive": SpecGenerator.from_pretrained(args.target, lookup=args.lookup, retune=args.retune)}
    fixed_shape = f"{args.total_tokens}x{args.depth}"
    warm = gens["plain"].encode([{"role": "user", "content": "Hello"}])
    for gen in gens.values():  # first calls' one-time costs (and the adaptive generator's tuning) untimed
        gen.generate(warm, max_new_tokens=8)
    tuning = gens["adaptive"].tuning(0.0) or {}
    costs = shape_costs(tuning)

    def record(name: str, result) -> dict:
        s = result.stats
        shapes = dict(s.shapes) if name == "adaptive" else {fixed_shape: s.cycles} if name == "fixed" else {}
        steps = s.plain_steps + sum(costs[k] * n for k, n in shapes.items())
        return {"plain_steps": s.plain_steps, "tree_cycles": shapes,
                "modelled_tokens_per_step": (s.new_tokens - 1) / steps if steps else 1.0}

    rows = take_turns(lambda name, ids: timed(gens[name], ids, args.max_new_tokens), list(METHODS),
                      gens["plain"].encode, args.per_category, record)

    def summary(selected: list[dict]) -> dict:
        out = {"prompts": len(selected)}
        for m in METHODS[1:]:
            out[m] = {"speedup": sum(r[m]["tokens_per_s"] / r["plain"]["tokens_per_s"] for r in selected)
                      / len(selected),
                      "modelled_speedup": sum(r[m]["modelled_tokens_per_step"] for r in selected) / len(selected),
                      "tau": sum(r[m]["tau"] for r in selected) / len(selected)}
        plain_cycles = sum(r["adaptive"]["plain_steps"] for r in selected)
        tree_cycles = sum(n for r in selected for n in r["adaptive"]["tree_cycles"].values())
        out["adaptive"]["plain_fraction"] = plain_cycles / max(plain_cycles + tree_cycles, 1)
        return out

    groups = {"all": rows, "turn 1": [r for r in rows if r["turn"] == 0], "turn 2": [r for r in rows if r["turn"] == 1]}
    groups |= {c: [r for r in rows if r["category"] == c] for c in dict.fromkeys(r["category"] for r in rows)}
    summaries = {name: summary(sel) for name, sel in groups.items()}
    result = {"target": args.target, "max_new_tokens": args.max_new_tokens, "fixed_tree": fixed_shape,
              "lookup": args.lookup, "tuning": tuning.get("reason"), "shape_costs": costs, "summary": summaries,
              "per_prompt": rows, "machine": machine_info(),
              "command": command_line("benchmarks.adaptive_vs_fixed", args.argv)}
    table = [[name, s["prompts"], f"{s['fixed']['speedup']:.3f}x (τ {s['fixed']['tau']:.2f})",
              f"{s['adaptive']['speedup']:.3f}x (τ {s['adaptive']['tau']:.2f}, "
              f"{s['adaptive']['plain_fraction']:.0%} plain steps)",
              f"{s['fixed']['modelled_speedup']:.3f}x / {s['adaptive']['modelled_speedup']:.3f}x"]
             for name, s in summaries.items()]
    text = (f"# Adaptation against a fixed tree · {args.target} · MT-Bench T=0\n\n"
            f"{args.per_category} questions per category, both turns, {args.max_new_tokens} new tokens, fp32, one "
            f"thread; the three methods take turns on every prompt and write the same tokens. Fixed: {fixed_shape} "
            f"(nodes x depth) + lookup {args.lookup}, no adaptation. Adaptive: the generator's default (tuned on "
            f"this machine: {tuning.get('reason', 'n/a')}) with the same chain. Speedup: mean over prompts of "
            "tokens/s over the plain loop's; modelled: new tokens per plain step's worth of cycles, a tree cycle "
            "at the tuner's cost for its shape.\n\n"
            + markdown_table(["prompts", "n", "fixed tree, wall", "adaptive, wall", "modelled, fixed / adaptive"],
                             table)
            + f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(result['machine'])}.\n")
    out = Path(args.out)
    write_benchmark(out.parent, out.name, result, text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
