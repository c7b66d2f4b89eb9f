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
import json
import sys
import time
from pathlib import Path

from griffin.cli import positive_int, run_cli
from griffin.constants import EMBEDDED_TARGET
from griffin.report import command_line, machine_info, machine_text, markdown_table, write_benchmark
from inference.questions import first_per_category, load_questions

METHODS = ("plain", "fixed", "adaptive")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.adaptive_vs_fixed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--per-category", type=positive_int, default=2, help="MT-Bench questions per category")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--depth", type=positive_int, default=3, help="the fixed tree's depth")
    p.add_argument("--total-tokens", type=positive_int, default=6, help="the fixed tree's nodes")
    p.add_argument("--lookup", type=int, default=10, help="prompt-lookup chain of both speculative methods")
    p.add_argument("--retune", action="store_true", help="measure the adaptive generator's tree again first")
    p.add_argument("--out", default="benchmarks/results/adaptive/adaptive-vs-fixed", help="path without suffix")
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
    questions = first_per_category(load_questions("mt_bench"), args.per_category)
    categories = list(dict.fromkeys(q["category"] for q in questions))
    warm = gens["plain"].encode([{"role": "user", "content": "Hello"}])
    for gen in gens.values():  # first calls' one-time costs (and the adaptive generator's tuning) untimed
        gen.generate(warm, max_new_tokens=8)
    tuning = gens["adaptive"].tunings.get(0.0) or {}
    costs = shape_costs(tuning)
    rows = []
    for q in questions:
        messages = [{"role": "user", "content": q["turns"][0]}]
        for turn in (0, 1):
            ids = gens["plain"].encode(messages)
            row = {"question_id": q["question_id"], "category": q["category"], "turn": turn}
            for name, gen in gens.items():
                start = time.perf_counter()
                result = gen.generate(ids, max_new_tokens=args.max_new_tokens)
                seconds = time.perf_counter() - start
                s = result.stats
                shapes = dict(s.shapes) if name == "adaptive" else {fixed_shape: s.cycles} if name == "fixed" else {}
                steps = s.plain_steps + sum(costs[k] * n for k, n in shapes.items())
                row[name] = {"tokens_per_s": s.new_tokens / seconds, "tau": s.tau, "new_tokens": s.new_tokens,
                             "plain_steps": s.plain_steps, "tree_cycles": shapes,
                             "modelled_tokens_per_step": (s.new_tokens - 1) / steps if steps else 1.0}
                if name == "plain":
                    answer, tokens = result.text, result.sequences[0, ids.shape[0]:].tolist()
                elif result.sequences[0, ids.shape[0]:].tolist() != tokens:
                    raise RuntimeError(f"question {q['question_id']} turn {turn + 1}: {name} wrote other tokens "
                                       "than the plain loop")
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("question_id", "turn")} | {
                m: round(row[m]["tokens_per_s"] / row["plain"]["tokens_per_s"], 3) for m in METHODS[1:]}),
                flush=True)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": q["turns"][1]}]

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
    groups |= {c: [r for r in rows if r["category"] == c] for c in categories}
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
