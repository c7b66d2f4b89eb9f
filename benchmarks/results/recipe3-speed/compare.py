"""The best EAGLE-3-generation head's speed runs beside the shipped GRIFFIN head's, on the same prompts (read from the
files; nothing is rerun).

Each speed run times its head and the plain decodings side by side in one process, so each speedup is a ratio within
its own run; two heads' runs are different runs, so their speedups compare as ratios, not their tokens/s. Here both
heads ran the same command in one session, on the same engine. A third row per dtype cuts the shipped head's headline
run (all 80 questions, on the engine of its day) to the same prompts and recomputes its speedup there, as a speed run
computes it (all new tokens / all seconds of each method; the fastest of ``generate`` and our plain loop as the
baseline).

    python benchmarks/results/recipe3-speed/compare.py

Writes ``compare.{json,md}`` beside this file.
"""

import json
from pathlib import Path

from griffin.report import markdown_table, paired_difference, pooled_tau, write_benchmark

HERE = Path("benchmarks/results/recipe3-speed")  # run from the repository root
HEADLINE = Path("benchmarks/results")
SUFFIX = {"fp32": "", "bf16": "-bf16"}
HEADS = [  # (row label, file stem without the dtype suffix, folder)
    ("griffin3 (recipe3, all 36 chunks, 17.47M tokens)", "mt_bench-recipe3-griffin3-T0", HERE),
    ("GRIFFIN (shipped, 15.76M tokens)", "mt_bench-shipped-griffin-T0", HERE),
    ("GRIFFIN (shipped), its headline run cut to these prompts", "mt_bench-smollm2-135m-instruct-griffin-lookup10-T0",
     HEADLINE),
]


def rate(prompts: list[dict], method: str) -> float:
    """New tokens per second of one method over ``prompts``."""
    return sum(p[method]["new_tokens"] for p in prompts) / sum(p[method]["seconds"] for p in prompts)


def summary(run: dict, prompts: list[dict]) -> dict:
    plain = {name: rate(prompts, key) for name, key in (("generate", "baseline"), ("own loop", "own_loop"))}
    fastest = max(plain, key=plain.get)
    return {**pooled_tau(prompts), "tree": run["tree"], "machine_date": run["machine"].get("date"),
            "fastest_plain": fastest, "speedup_vs_fastest_plain": rate(prompts, "ours") / plain[fastest]}


def main() -> None:
    rows, records, diffs = [], [], []
    for dtype, suffix in SUFFIX.items():
        runs = [json.loads((folder / f"{stem}{suffix}.json").read_text()) for _, stem, folder in HEADS]
        asked = {(p["question_id"], p["turn"]) for p in runs[0]["per_prompt"]}
        prompts = [[p for p in run["per_prompt"] if (p["question_id"], p["turn"]) in asked] for run in runs]
        record = {"dtype": dtype, "heads": [], "tau_griffin3_minus_shipped": paired_difference(prompts[0], prompts[1])}
        for (label, stem, folder), run, mine in zip(HEADS, runs, prompts, strict=True):
            r = {"head": label, "file": f"{stem}{suffix}.json", **summary(run, mine)}
            record["heads"].append(r)
            link = f"{stem}{suffix}.md" if folder == HERE else f"../{stem}{suffix}.md"
            rows.append([dtype, label, r["n_prompts"], f"{r['tau']:.2f} ± {r['se']:.2f}",
                         f"{r['speedup_vs_fastest_plain']:.2f}x ({r['fastest_plain']})", r["machine_date"],
                         f"[{Path(link).name}]({link})"])
        records.append(record)
        d = record["tau_griffin3_minus_shipped"]
        diffs.append(f"- {dtype}: τ(griffin3) − τ(shipped GRIFFIN) = {d['diff']:+.3f} ± {d['se']:.3f} "
                     f"({d['n_prompts']} prompts)")
    table = markdown_table(["dtype", "head", "prompts", "τ (with the lookup chain)", "speedup vs fastest plain",
                            "run", "file"], rows)
    markdown = ("# The best EAGLE-3-generation head in the headline speed run\n\nMT-Bench, the first 20 questions "
                "(both turns), T=0, 128 new tokens, `--lookup 10`, the tree tuned per head and adapted per request. "
                "Each speedup is against the fastest plain decoding timed in its own run.\n\n" + table
                + "\nτ paired per prompt, each head with its own tuned and adapted tree (this session's runs):\n\n"
                + "\n".join(diffs) + "\n\nCommand: `python benchmarks/results/recipe3-speed/compare.py`\n")
    write_benchmark(HERE, "compare", {"runs": records, "command": "python benchmarks/results/recipe3-speed/compare.py"},
                    markdown)


if __name__ == "__main__":
    main()
