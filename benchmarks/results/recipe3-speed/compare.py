"""The best EAGLE-3-generation head's speed runs beside the shipped GRIFFIN head's headline runs, on the same prompts
(read from the files; nothing is rerun).

Each speed run times the head and the plain decodings side by side in one process, so each speedup is a ratio within
its own run; the two heads' runs are different runs, on the same Xeon, so their speedups compare as ratios, not their
tokens/s. The shipped head's headline files cover all 80 MT-Bench questions; here they are cut to the questions the
new head's runs answered, and their speedups recomputed over those prompts as a speed run computes them (all new
tokens / all seconds of each method; the fastest of ``generate`` and our plain loop as the baseline).

    python benchmarks/results/recipe3-speed/compare.py

Writes ``compare.{json,md}`` beside this file.
"""

import json
from pathlib import Path

from griffin.report import markdown_table, paired_difference, pooled_tau, write_benchmark

HERE = Path("benchmarks/results/recipe3-speed")  # run from the repository root
SHIPPED = Path("benchmarks/results")
RUNS = [  # (dtype, the new head's run, the shipped head's headline run)
    ("fp32", "mt_bench-recipe3-griffin3-T0", "mt_bench-smollm2-135m-instruct-griffin-lookup10-T0"),
    ("bf16", "mt_bench-recipe3-griffin3-T0-bf16", "mt_bench-smollm2-135m-instruct-griffin-lookup10-T0-bf16"),
]


def rate(prompts: list[dict], method: str) -> float:
    """New tokens per second of one method over ``prompts``."""
    return sum(p[method]["new_tokens"] for p in prompts) / sum(p[method]["seconds"] for p in prompts)


def summary(prompts: list[dict]) -> dict:
    plain = {name: rate(prompts, key) for name, key in (("generate", "baseline"), ("own loop", "own_loop"))}
    fastest = max(plain, key=plain.get)
    return {**pooled_tau(prompts), "fastest_plain": fastest,
            "speedup_vs_fastest_plain": rate(prompts, "ours") / plain[fastest]}


def main() -> None:
    rows, records = [], []
    for dtype, mine_stem, shipped_stem in RUNS:
        mine = json.loads((HERE / f"{mine_stem}.json").read_text())
        shipped = json.loads((SHIPPED / f"{shipped_stem}.json").read_text())
        asked = {(p["question_id"], p["turn"]) for p in mine["per_prompt"]}
        theirs = [p for p in shipped["per_prompt"] if (p["question_id"], p["turn"]) in asked]
        record = {"dtype": dtype, "griffin3": {"file": f"{mine_stem}.json", "tree": mine["tree"],
                                               "identical_fraction": mine["identical_fraction"],
                                               **summary(mine["per_prompt"])},
                  "shipped_griffin": {"file": f"{shipped_stem}.json", "tree": shipped["tree"],
                                      **summary(theirs)},
                  "tau_griffin3_minus_shipped": paired_difference(mine["per_prompt"], theirs)}
        records.append(record)
        for name, key, link in (("griffin3 (recipe3, 12.92M tokens)", "griffin3", f"{mine_stem}.md"),
                                ("GRIFFIN (shipped, 15.76M tokens)", "shipped_griffin", f"../{shipped_stem}.md")):
            r = record[key]
            speedup = f"{r['speedup_vs_fastest_plain']:.2f}x ({r['fastest_plain']})"
            rows.append([dtype, name, r["n_prompts"], f"{r['tau']:.2f} ± {r['se']:.2f}", speedup,
                         f"[{Path(link).name}]({link})"])
    table = markdown_table(["dtype", "head", "prompts", "τ (with the lookup chain)", "speedup vs fastest plain",
                            "file"], rows)
    diffs = "\n".join(f"- {r['dtype']}: τ(griffin3) − τ(shipped GRIFFIN) = {d['diff']:+.3f} ± {d['se']:.3f} "
                      f"({d['n_prompts']} prompts)" for r in records if (d := r["tau_griffin3_minus_shipped"]))
    markdown = ("# The best EAGLE-3-generation head in the headline speed run\n\nMT-Bench, the first 20 questions "
                "(both turns), T=0, 128 new tokens, `--lookup 10`, the tree tuned per head and adapted per request. "
                "Each speedup is against the fastest plain decoding timed in its own run.\n\n" + table
                + "\nτ paired per prompt, each head with its own tuned and adapted tree:\n\n" + diffs
                + "\n\nCommand: `python benchmarks/results/recipe3-speed/compare.py`\n")
    write_benchmark(HERE, "compare", {"runs": records, "command": "python benchmarks/results/recipe3-speed/compare.py"},
                    markdown)


if __name__ == "__main__":
    main()
