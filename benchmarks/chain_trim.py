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
import json
import statistics
import sys
import time
from pathlib import Path

from griffin.cli import positive_int, run_cli
from griffin.constants import EMBEDDED_TARGET
from griffin.report import command_line, machine_info, machine_text, markdown_table, write_benchmark
from inference.questions import first_per_category, load_questions

# name -> (static shapes, the chain's n-gram sizes)
VARIANTS = {"static, n-grams 3/2/1": (True, (3, 2, 1)), "trimmed, n-grams 3/2/1": (False, (3, 2, 1)),
            "trimmed, n-grams 3/2": (False, (3, 2)), "trimmed, n-grams 3": (False, (3,))}
BASE = "static, n-grams 3/2/1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chain_trim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--per-category", type=positive_int, default=2, help="MT-Bench questions per category")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--depth", type=positive_int, default=3, help="the tree's depth")
    p.add_argument("--total-tokens", type=positive_int, default=6, help="the tree's nodes")
    p.add_argument("--lookup", type=positive_int, default=10, help="the prompt-lookup chain's tokens")
    p.add_argument("--out", default="benchmarks/results/chain-trim/chain-trim", help="path without suffix")
    args = p.parse_args(argv)
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
            gen = plain
        else:
            gen = tree
            gen.static_shapes, gen.lookup_ngrams = VARIANTS[name]
        start = time.perf_counter()
        result = gen.generate(ids, max_new_tokens=args.max_new_tokens)
        return time.perf_counter() - start, result

    warm = plain.encode([{"role": "user", "content": "Hello"}])
    for name in ("plain", *VARIANTS):  # first calls' one-time costs untimed
        generate(name, warm)
    questions = first_per_category(load_questions("mt_bench"), args.per_category)
    rows = []
    for q in questions:
        messages = [{"role": "user", "content": q["turns"][0]}]
        for turn in (0, 1):
            ids = plain.encode(messages)
            row = {"question_id": q["question_id"], "category": q["category"], "turn": turn}
            for name in ("plain", *VARIANTS):
                seconds, result = generate(name, ids)
                s = result.stats
                row[name] = {"tokens_per_s": s.new_tokens / seconds, "tau": s.tau, "new_tokens": s.new_tokens}
                if name == "plain":
                    answer, tokens = result.text, result.sequences[0, ids.shape[0]:].tolist()
                elif result.sequences[0, ids.shape[0]:].tolist() != tokens:
                    raise RuntimeError(f"question {q['question_id']} turn {turn + 1}: {name} wrote other tokens "
                                       "than the plain loop")
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("question_id", "turn")} | {
                name: round(row[name]["tokens_per_s"] / row["plain"]["tokens_per_s"], 3) for name in VARIANTS}),
                flush=True)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": q["turns"][1]}]

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
