"""Regenerate the results section of benchmarks/README.md from the committed speed-run files.

    python -m benchmarks.headline

Reads ``benchmarks/results/<bench>-<head>[-lookup<K>]-T<temp>[-bf16].json`` for the shipped default head (runs with
``--lookup K`` add a prompt-lookup chain to its tree) and ``ablation.md``, and rewrites the text between
``<!-- results:start -->`` and ``<!-- results:end -->`` in ``--readme`` (benchmarks/README.md; links relative to it).
Only runs of the head's present weights count (their ``draft_digest``; runs of an earlier head of the same name are
named and left out). The project README's headline table is written by hand from the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from griffin.cli import run_cli
from griffin.io import weights_digest
from griffin.report import fastest_plain, fill_section, markdown_table, result_stem, tree_text
from inference.questions import BENCHES


def peer_text(r: dict) -> str:
    """Prompt lookup's speedup over ``generate`` as a ratio of tokens/s (older runs stored only a ratio of times)."""
    if "prompt_lookup_tokens_per_s" in r and "baseline_tokens_per_s" in r:
        return f"{r['prompt_lookup_tokens_per_s'] / r['baseline_tokens_per_s']:.2f}x"
    return f"{r['peers']['prompt_lookup']:.2f}x" if "peers" in r else "-"


def cpu_text(machine: dict) -> str:
    """A result's CPU model name without trademark signs and the word Processor, marked (AMX) where the CPU has
    matrix tiles (bf16 matrix products several times faster than with AVX alone)."""
    cpu = machine["cpu"]
    name = " ".join(w for w in cpu.replace("(R)", "").replace("(TM)", "").split() if w != "Processor")
    return name + (" (AMX)" if "amx_bf16" in machine.get("cpu_flags", []) else "")


def tree_cell(r: dict) -> str:
    """A run's tree: the one it held, or for runs that adapted it per request (a tuned tree and a recorded plain-step
    fraction, :mod:`griffin.adapt`) the tuned choice they started from and the share of plain steps."""
    tree = r["tree"]
    held = "the plain loop" if tree["depth"] == 0 else tree_text(tree)
    if not (r.get("tuning") and "plain_fraction" in r):
        return held
    chain = f"; trees + lookup {tree['lookup']}" if tree["depth"] == 0 and tree.get("lookup") else ""
    return f"adaptive from {held}{chain}, {r['plain_fraction']:.0%} plain steps"


def tags(results_dir: Path, head: str) -> list[str]:
    """The head's name, then ``<head>-lookup<K>`` for every K with a speed run, smallest first."""
    found = {int(p.name.split(f"{head}-lookup", 1)[1].split("-", 1)[0])
             for p in results_dir.glob(f"*-{head}-lookup*-T*.json")}
    return [head] + [f"{head}-lookup{k}" for k in sorted(found)]


def section(results_dir: Path, head: str, checkpoints: Path) -> tuple[str, list[str]]:
    """-> (the results section, the files left out as runs of other weights than the head's present ones)."""
    digest = weights_digest(checkpoints / head)
    rows = []
    commands = []
    stale = []
    runs = [(tag, dtype, temperature, bench) for dtype in ("fp32", "bf16") for temperature in (0, 1)
            for tag in tags(results_dir, head) for bench in BENCHES]
    for tag, dtype, temperature, bench in runs:
        path = results_dir / f"{result_stem(bench, tag, temperature, dtype)}.json"
        if not path.is_file():
            continue
        r = json.loads(path.read_text())
        if r.get("draft_digest") != digest:
            stale.append(path.name)
            continue
        best = fastest_plain(r)
        plain = [f"{r['baseline_tokens_per_s']:.1f}" if "baseline_tokens_per_s" in r else "-",
                 f"{r['own_loop_tokens_per_s']:.1f} ({r.get('own_loop_one_row', 'linear')})"
                 if "own_loop_tokens_per_s" in r else "-"]
        rows.append([bench, r["temperature"], r.get("dtype", dtype), cpu_text(r["machine"]),
                     r["machine"].get("torch_threads", "-"),
                     r["n_prompts"], r["max_new_tokens"],
                     tree_cell(r), r["tau"], f"**{best[0]:.2f}x** ({best[1]})" if best else "-",
                     f"{r['tokens_per_s'] / r['baseline_tokens_per_s']:.2f}x" if "baseline_tokens_per_s" in r
                     else "-", f"{r['tokens_per_s']:.1f}", *plain,
                     peer_text(r),
                     r.get("identical_fraction", "-"), f"[json]({path.as_posix()})"])
        commands.append(r["command"])
        machine = r["machine"]
    if not rows:
        return "No headline speed runs yet.\n\n" + costs(results_dir), stale
    text = (f"Head `checkpoints/{head}`, one process per run, every method timed side by side after a warm-up, the "
            f"target in the dtype shown for all of them, on the CPU shown ({machine['cores']} cores, torch "
            f"{machine['torch']}). The headline speedup is against the fastest plain decoding of the same run: the "
            "higher tokens/s of transformers `generate` and our plain loop, whose one-row kernel is shown beside it "
            "(runs from 2026-11-24 on: the fastest measured on that machine, `griffin.kernels.choose_kernels`; "
            "earlier ones: a fixed table from the AMD EPYC, "
            f"[plain-kernel.md]({results_dir.as_posix()}/plain-kernel.md), or "
            "`F.linear`, shown as linear). Speedups are ratios of tokens/s (at T=0 the same as ratios of wall time, "
            "since every method writes the same tokens). Threads: torch's intra-op threads of the run, the same for "
            "every method in it.\n\n")
    text += markdown_table(["bench", "T", "dtype", "CPU", "threads", "prompts", "max new", "tree", "τ",
                            "speedup vs fastest plain", "speedup vs HF generate", "tokens/s", "HF generate tokens/s",
                            "plain loop tokens/s", "prompt lookup speedup", "identical", "file"], rows)
    once = dict.fromkeys(commands)  # in order, each once: one `--bench all` run writes several files
    text += "\nτ: new tokens per target forward pass. Commands:\n\n" + "".join(f"- `{c}`\n" for c in once)
    ablation = results_dir / "ablation.md"
    if ablation.is_file():
        table = "".join(line + "\n" for line in first_table(ablation.read_text()))
        text += ("\nAblation: acceptance length τ of the heads, all with the same tree; heads with the same `tokens` "
                 "trained on the same data with one schedule "
                 f"([{ablation.as_posix()}]({ablation.as_posix()})):\n\n{table}"
                 f"\n![ablation]({ablation.with_suffix('.png').as_posix()})\n")
    return text + "\n" + costs(results_dir), stale


def first_table(markdown: str) -> list[str]:
    """The lines of the first markdown table in ``markdown`` (the ablation's τ table; its paired table follows)."""
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), len(lines))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def costs(results_dir: Path) -> str:
    """Engine ceiling, verification profile and pipeline throughput, from ``engine.json``, ``verify-profile.json`` and
    ``pipeline-throughput.json`` when present."""
    lines = []
    engine = results_dir / "engine.json"
    if engine.is_file():
        e = json.loads(engine.read_text())
        best = max(e["oracle"].items(), key=lambda kv: kv[1]["speedup_vs_generate"])
        lines.append(f"- Engine ([{engine.as_posix()}]({engine.as_posix()})): one transformers `generate` step costs "
                     f"{e['generate_step_s'] * 1000:.0f} ms, our plain loop's {e['own_loop_step_s'] * 1000:.0f} ms, "
                     f"a speculative cycle (untrained head, {e['tree']['total_tokens']}-node tree) "
                     f"{e['untrained_cycle_s'] * 1000:.0f} ms; an oracle drafter (the head's ceiling) reaches "
                     f"{best[1]['speedup_vs_generate']:.2f}x over `generate` ({best[0].replace('_', ' ')}).")
        curves = e["forward_cost_s"]
        if len(curves) == 2:  # F.linear and weight-major
            (plain_name, plain), (fast_name, fast) = curves.items()
            lines.append(f"- Verifying n tokens in one target forward ({plain_name} -> {fast_name}): n=4 costs "
                         f"{plain['4'] / plain['1']:.2f}x -> {fast['4'] / plain['1']:.2f}x a one-token step, n=8 "
                         f"{plain['8'] / plain['1']:.2f}x -> {fast['8'] / plain['1']:.2f}x, n=25 "
                         f"{plain['25'] / plain['1']:.2f}x.")
    profile = results_dir / "verify-profile.json"
    if profile.is_file():
        p = json.loads(profile.read_text())
        n, run = ("4", p["runs"]["4"]) if "4" in p["runs"] else next(iter(p["runs"].items()))
        parts = ", ".join(f"{group} {seconds * 1000:.1f} ms" for group, seconds in run["groups_s"].items())
        lines.append(f"- Profile of a {n}-token verification forward ([{profile.as_posix()}]({profile.as_posix()})): "
                     f"{run['wall_s'] * 1000:.1f} ms unprofiled; profiled, {parts}, outside any operator "
                     f"{run['unattributed_s'] * 1000:.1f} ms. The matrix products read "
                     f"{p['linear_weight_bytes'] / 1e6:.0f} MB of weights at "
                     f"{p['linear_weight_bytes'] / run['groups_s']['matrix products'] / 1e9:.0f} GB/s.")
    pipeline = results_dir / "pipeline-throughput.json"
    if pipeline.is_file():
        r = json.loads(pipeline.read_text())
        feats = ", ".join(f"{f['tokens_per_s']:.0f} tokens/s in {f['compute_dtype']}" for f in r["features"])
        train = ", ".join(f"K={t['steps']} {'bf16' if t['mixed_precision'] == 'bf16' else 'fp32'} "
                          f"{t['tokens_per_s']:.0f}" for t in r["training"])
        regen = ""
        if "regeneration" in r:
            best = max(r["regeneration"]["rows"], key=lambda x: x["tokens_per_s"])
            regen = (f"; regeneration at most {best['tokens_per_s']:.1f} new tokens/s ({best['engine']}, "
                     f"{best['dtype']}, batch {best['batch_size']}, {best['cache']} cache, {best['threads']} thread"
                     f"{'' if best['threads'] == 1 else 's'})")
        lines.append(f"- Training pipeline ([{pipeline.as_posix()}]({pipeline.as_posix()})): features {feats}; "
                     f"training tokens/s {train}{regen}.")
    if not lines:
        return ""
    machine = json.loads((engine if engine.is_file() else pipeline).read_text())["machine"]
    return f"On {machine['cpu']} ({machine['cores']} cores):\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.headline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--readme", default="benchmarks/README.md")
    p.add_argument("--results", default="benchmarks/results")
    p.add_argument("--head", default="smollm2-135m-instruct-griffin")
    p.add_argument("--checkpoints", default="checkpoints", help="the folder of the head")
    args = p.parse_args(argv)
    readme = Path(args.readme)
    results, stale = section(Path(args.results), args.head, Path(args.checkpoints))
    link = Path(os.path.relpath(args.results, readme.resolve().parent)).as_posix()  # the results folder from the readme
    results = results.replace(f"]({Path(args.results).as_posix()}/", f"]({link}/")
    fill_section(readme, "results", results)
    if stale:
        print(f"left out {len(stale)} runs of other weights than {Path(args.checkpoints) / args.head}'s: "
              f"{', '.join(stale)}")
    print(f"updated the results section of {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
