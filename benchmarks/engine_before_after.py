"""CPU speed of the speculative engine before and after a change, side by side on the embedded target.

    git archive <base commit> | tar -x -C /tmp/base
    python benchmarks/engine_before_after.py --base /tmp/base --trees 1,8,3 5,8,24 --repeats 3

Each side is a code tree (``--base`` and this checkout). For every tree shape, temperature and repeat, each side runs
in its own process, one after the other: the embedded SmolLM2 target (fp32, one thread) with its shipped GRIFFIN head
generates 128 new tokens for the first question of each of the first MT-Bench questions. Reported per side: new tokens
per second of wall time and of process CPU time (the latter is less disturbed by other jobs on a shared machine),
acceptance length τ, and whether both sides wrote the same tokens. Results: ``<out-dir>/engine-before-after.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.report import machine_info, markdown_table, write_benchmark  # noqa: E402

# runs inside a side's code tree: python -c RUN depth top_k total temperature prompts max_new out.json
RUN = r"""
import json, sys, time
import torch
from griffin import SpecGenerator
from griffin.target import load_target
from inference.questions import load_questions

depth, top_k, total, temp, n_prompts, max_new, out = *map(int, sys.argv[1:4]), float(sys.argv[4]), *map(int, sys.argv[5:7]), sys.argv[7]
torch.set_num_threads(1)
model, tok = load_target("smollm2-135m-instruct", dtype="fp32")
gen = SpecGenerator.from_pretrained(model, None, tokenizer=tok, depth=depth, top_k=top_k, total_tokens=total)
prompts = [q["turns"][0] for q in load_questions("mt_bench", n_prompts)]
gen.generate(gen.encode([{"role": "user", "content": "Hello! Who are you?"}]), max_new_tokens=32, temperature=temp,
             seed=0)
rows = []
for i, prompt in enumerate(prompts):
    ids = gen.encode([{"role": "user", "content": prompt}])
    wall, cpu = time.perf_counter(), time.process_time()
    r = gen.generate(ids, max_new_tokens=max_new, temperature=temp, seed=i)
    rows.append({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                 "new_tokens": r.stats.new_tokens, "cycles": r.stats.cycles,
                 "tokens": r.sequences[0, ids.shape[0]:].tolist()})
json.dump(rows, open(out, "w"))
"""


def run_side(code: Path, tree: tuple[int, int, int], temperature: float, args) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code), "TQDM_DISABLE": "1"}
        subprocess.run([sys.executable, "-c", RUN, *map(str, tree), str(temperature), str(args.prompts),
                        str(args.max_new_tokens), out.name], cwd=code, env=env, check=True)
        return json.loads(Path(out.name).read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="code tree of the version before the change")
    p.add_argument("--trees", nargs="+", default=["1,8,3", "5,8,24"], help="depth,top_k,total_tokens")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    sides = {"before": Path(args.base).resolve(), "after": ROOT}
    runs: dict[str, dict[str, list]] = {}
    for repeat in range(args.repeats):
        for spec in args.trees:
            tree = tuple(int(v) for v in spec.split(","))
            for temperature in args.temperatures:
                key = f"tree {tree[2]} nodes, depth {tree[0]}, top-k {tree[1]}, T={temperature:g}"
                for side, code in sides.items():
                    rows = run_side(code, tree, temperature, args)
                    runs.setdefault(key, {}).setdefault(side, []).append(rows)
                    print(f"[{repeat + 1}/{args.repeats}] {key} {side}: "
                          f"{sum(r['new_tokens'] for r in rows) / sum(r['cpu_s'] for r in rows):.2f} tokens/s (CPU)",
                          flush=True)
    summary, table = {}, []
    for key, by_side in runs.items():
        summary[key] = {}
        for side, repeats in by_side.items():
            def rate(field: str, rows: list[dict]) -> float:
                return sum(r["new_tokens"] for r in rows) / sum(r[field] for r in rows)

            cpu = sorted(rate("cpu_s", rows) for rows in repeats)
            wall = sorted(rate("wall_s", rows) for rows in repeats)
            rows0 = repeats[0]
            summary[key][side] = {"tokens_per_cpu_s": cpu, "tokens_per_wall_s": wall,
                                  "tau": sum(r["new_tokens"] for r in rows0) / sum(r["cycles"] for r in rows0)}
        same = [a["tokens"] == b["tokens"] for a, b in zip(by_side["before"][0], by_side["after"][0])]
        summary[key]["same_tokens_fraction"] = sum(same) / len(same)
        b, a = summary[key]["before"], summary[key]["after"]
        median = len(b["tokens_per_cpu_s"]) // 2
        table.append([key, b["tokens_per_cpu_s"][median], a["tokens_per_cpu_s"][median],
                      a["tokens_per_cpu_s"][median] / b["tokens_per_cpu_s"][median], b["tokens_per_wall_s"][median],
                      a["tokens_per_wall_s"][median], b["tau"], a["tau"], summary[key]["same_tokens_fraction"]])
    command = "python benchmarks/engine_before_after.py " + " ".join(sys.argv[1:])
    result = {"runs": summary, "repeats": args.repeats, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "machine": machine_info(), "command": command}
    md = ("# Speculative engine on CPU: before and after\n\nEmbedded SmolLM2-135M target (fp32, 1 thread) with its "
          f"shipped GRIFFIN head, first turns of the first {args.prompts} MT-Bench questions, {args.max_new_tokens} "
          f"new tokens; medians of {args.repeats} runs per side, the sides alternating. CPU time is the process's "
          "own (the machine is shared); wall time is what a user waits.\n\n"
          + markdown_table(["setting", "before tok/s (CPU)", "after tok/s (CPU)", "after / before",
                            "before tok/s (wall)", "after tok/s (wall)", "τ before", "τ after", "same tokens"], table)
          + f"\nCommand: `{command}`\n\nMachine: {result['machine']['cpu']}, {result['machine']['cores']} cores, "
          f"torch {result['machine']['torch']}, {result['machine']['date']}.\n")
    write_benchmark(args.out_dir, "engine-before-after", result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
