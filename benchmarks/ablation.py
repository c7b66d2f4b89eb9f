"""The GRIFFIN paper's ablation on our target: acceptance length of five heads trained on the same data and budget.

    python -m benchmarks.ablation --run --replay  # offline replays (inference.tau) of every head, then the report
    python -m benchmarks.ablation --run          # speed runs of the real engine (our generator only), then the report
    python -m benchmarks.ablation                # only rebuild the report from existing results

Heads are ``checkpoints/<target>-<name>`` for the names below; every head uses the same tree and generation settings.
Only runs of a head's present weights count (the weights digest each run records).
Two sources of τ, the same quantity (:mod:`inference.tau` says why): ``--replay`` replays every head's
drafting against the target's stored continuations (:mod:`inference.tau`: one target forward per prompt for all five
heads, minutes instead of hours), files ``tau-<bench>-T<temp>.json``; without it, speed runs of the generator, files
``<bench>-<target>-<head>-T<temp>.json``. Either goes to ``benchmarks/results/ablation/``; the report to
``benchmarks/results/ablation.md`` (table of τ, and GRIFFIN against each head paired over the same prompts) and
``ablation.png`` (plot).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

from griffin.cli import run_cli
from griffin.io import atomic_write, atomic_write_text, weights_digest
from griffin.report import markdown_table, paired_difference
from inference.questions import BENCHES

HEADS = {  # label -> checkpoint suffix; arch, K and top-k of each in the model cards
    "GRIFFIN": "griffin",
    "w/o TAT (griffin, K=1)": "griffin-k1",
    "w/o TAD (eagle, K=3, top-3 mask)": "eagle-tat",
    "HASS (eagle, K=3, no mask)": "hass",
    "EAGLE-2 (eagle, K=1)": "eagle2",
}
BASELINE = "EAGLE-2 (eagle, K=1)"
OURS = "GRIFFIN"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="store_true", help="run the missing runs first")
    p.add_argument("--replay", action="store_true",
                   help="τ from offline replays (inference.tau) instead of speed runs, for --run and the report")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--checkpoints", default="checkpoints")
    p.add_argument("--results", default="benchmarks/results/ablation",
                   help="folder of the ablation's runs (apart from the headline runs, whose tree may be tuned per "
                        "head)")
    p.add_argument("--report", default="benchmarks/results/ablation.md", help="the table; the plot goes beside it")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None,
                   help="only the first n questions of every run (default: all of MT-Bench at T=0, the first 20 "
                        "questions of the other runs)")
    p.add_argument("--depth", type=int, default=5, help="one fixed tree for every head (not tuned per head)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--total-tokens", type=int, default=24)
    p.add_argument("--benches", default=",".join(BENCHES), help="benches to run (the report shows all it finds)")
    p.add_argument("--heads", default=",".join(HEADS.values()),
                   help="comma-separated checkpoint suffixes to run (the report shows all it finds; speed runs: "
                        "split them over several processes to use more cores)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the replays")
    return p.parse_args(argv)


def run_limit(args, bench: str, temperature: float) -> int | None:
    if args.limit is not None:
        return args.limit
    return None if bench == "mt_bench" and temperature == 0 else 20


def result_path(args, bench: str, suffix: str, temperature: float) -> Path:
    return Path(args.results) / f"{bench}-{args.target}-{suffix}-T{temperature:g}.json"


def replay_path(args, bench: str, temperature: float) -> Path:
    return Path(args.results) / f"tau-{bench}-T{temperature:g}.json"


def tree_argv(args, bench: str, temperature: float) -> list[str]:
    argv = ["--max-new-tokens", str(args.max_new_tokens), "--depth", str(args.depth), "--top-k", str(args.top_k),
            "--total-tokens", str(args.total_tokens)]
    limit = run_limit(args, bench, temperature)
    return argv + (["--limit", str(limit)] if limit is not None else [])


def run_missing(args, temperatures: list[float]) -> None:
    from inference import speed

    for suffix in args.heads.split(","):
        head = Path(args.checkpoints) / f"{args.target}-{suffix}"
        for temperature in temperatures:
            for bench in args.benches.split(","):
                if result_path(args, bench, suffix, temperature).is_file():
                    continue
                speed.main(["--bench", bench, "--draft", str(head), "--methods", "ours", "--temperature",
                            str(temperature), "--out-dir", args.results, *tree_argv(args, bench, temperature)])


def run_missing_replays(args, temperatures: list[float]) -> None:
    """One replay per bench and temperature with every head at once (the target's forward is shared)."""
    from inference import tau

    heads = [str(Path(args.checkpoints) / f"{args.target}-{suffix}") for suffix in args.heads.split(",")]
    for temperature in temperatures:
        for bench in args.benches.split(","):
            path = replay_path(args, bench, temperature)
            if path.is_file():
                continue
            tau.main(["--heads", *heads, "--bench", bench, "--temperatures", f"{temperature:g}",
                      "--threads", str(args.threads), "--out", str(path.with_suffix("")),
                      *tree_argv(args, bench, temperature)])


def head_digest(args, suffix: str) -> str | None:
    """The weights digest of a head's checkpoint (None where it is missing: none of its runs count)."""
    folder = Path(args.checkpoints) / f"{args.target}-{suffix}"
    return weights_digest(folder) if (folder / "config.json").is_file() else None


def speed_runs(args, columns: list[tuple]) -> tuple[dict[str, dict[tuple, dict]], list[str]]:
    """-> ({label: {(bench, T): run}}, each run with tau, per_prompt, n_prompts, command, tree and max_new_tokens;
    the runs left out because they measured other weights than the head's present ones)."""
    runs: dict[str, dict[tuple, dict]] = {}
    stale = []
    for label, suffix in HEADS.items():
        digest = head_digest(args, suffix)
        for bench, t in columns:
            path = result_path(args, bench, suffix, t)
            if not path.is_file():
                continue
            run = json.loads(path.read_text())
            if run.get("draft_digest") != digest:
                stale.append(path.name)
                continue
            runs.setdefault(label, {})[(bench, t)] = run
    return runs, stale


def replays(args, columns: list[tuple]) -> tuple[dict[str, dict[tuple, dict]], list[str]]:
    """The same as :func:`speed_runs`, read from the replay files (one per column, every head in it)."""
    runs: dict[str, dict[tuple, dict]] = {}
    stale = []
    for bench, t in columns:
        path = replay_path(args, bench, t)
        if not path.is_file():
            continue
        result = json.loads(path.read_text())
        for label, suffix in HEADS.items():
            name = f"{args.target}-{suffix}"
            run = result["heads"].get(name, {}).get(f"{t:g}")
            if run is None:
                continue
            if result.get("head_digests", {}).get(name) != head_digest(args, suffix):
                stale.append(f"{path.name} ({suffix})")
                continue
            runs.setdefault(label, {})[(bench, t)] = {
                **run, "command": result["command"], "tree": result["tree"],
                "max_new_tokens": result["max_new_tokens"]}
    return runs, stale


def standard_error(values: list[float]) -> float | None:
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None


def report(args, temperatures: list[float]) -> str:
    columns = [(b, t) for t in temperatures for b in BENCHES]
    runs, stale = (replays if args.replay else speed_runs)(args, columns)
    if stale:
        print(f"left out {len(stale)} runs of other weights than the heads' present ones: {', '.join(stale)}")
    if not runs:
        raise FileNotFoundError(f"no ablation results under {args.results}: run with --run first"
                                + (" --replay" if args.replay else ""))
    taus = {label: {c: run["tau"] for c, run in found.items()} for label, found in runs.items()}
    errors = {label: {c: e for c, run in found.items()
                      if (e := standard_error([p["tau"] for p in run.get("per_prompt", [])])) is not None}
              for label, found in runs.items()}
    prompts: dict[tuple, set] = {}
    for found in runs.values():
        for c, run in found.items():
            prompts.setdefault(c, set()).add(run["n_prompts"])
    commands = {run["command"] for found in runs.values() for run in found.values()}
    settings = next((run["tree"], run["max_new_tokens"]) for found in runs.values() for run in found.values())
    columns = [c for c in columns if c in prompts]
    names = [f"{b} T={t:g} ({'/'.join(map(str, sorted(prompts[(b, t)])))})" for b, t in columns]
    headers = ["head"] + names + ["mean", f"mean vs {BASELINE.split(' ')[0]}"]
    base = taus.get(BASELINE, {})
    rows = []
    for label in HEADS:
        if label not in taus:
            continue
        values = [taus[label].get(c) for c in columns]
        present = [v for v in values if v is not None]
        mean = sum(present) / len(present)
        ratios = [v / base[c] for v, c in zip(values, columns) if v is not None and c in base]
        rows.append([label] + [cell(v, errors.get(label, {}).get(c)) for v, c in zip(values, columns)] + [mean] +
                    [f"{sum(ratios) / len(ratios):.3f}x" if ratios else "-"])
    source = ("offline replays of each head's drafting against the target's stored continuations "
              "(`inference.tau`, whose docstring shows why that is the engine's τ)" if args.replay else
              "speed runs of the generator")
    text = ("# Ablation: acceptance length τ on SmolLM2-135M-Instruct\n\n"
            f"τ = new tokens per target forward pass, from {source}. Same features, data split and number of updates "
            f"for every head; tree {settings[0]}, up to {settings[1]} new tokens, fp32 target. Column headers give "
            "the number of prompts (MT-Bench: both turns of each question); ± is the standard error of the mean of "
            "per-prompt τ (the spread over prompts; at T=0 all heads answer the same prompts, so a difference between "
            "heads is less noisy than that: see the paired table).\n\n" + markdown_table(headers, rows))
    text += paired_section(runs, columns, names)
    text += (f"\nProduced by `python -m benchmarks.ablation{' --replay' if args.replay else ''}`, from these runs:\n\n"
             + "".join(f"- `{c}`\n" for c in sorted(commands)))
    plot(args, taus, errors, columns)
    return text


def paired_section(runs: dict[str, dict[tuple, dict]], columns: list[tuple], names: list[str]) -> str:
    """GRIFFIN minus each other head, per column, paired over the prompts both ran (empty without GRIFFIN)."""
    ours = runs.get(OURS, {})
    rows = []
    for label, found in runs.items():
        if label == OURS:
            continue
        row = [label]
        for c in columns:
            pair = (paired_difference(ours[c].get("per_prompt", []), found[c].get("per_prompt", []))
                    if c in ours and c in found else None)
            if pair is None:
                row.append("-")
                continue
            error = "" if math.isnan(pair["se"]) else f" ± {pair['se']:.3f}"
            row.append(f"{pair['mean']:+.3f}{error} ({ours[c]['tau'] / found[c]['tau']:.3f}x)")
        rows.append(row)
    if not rows or all(v == "-" for row in rows for v in row[1:]):
        return ""
    return (f"\n## {OURS} against each head, paired\n\nMean over the prompts both heads ran of τ({OURS}) − τ(head), ± "
            f"its standard error, and the ratio of the two τ.\n\n" + markdown_table(["head"] + names, rows))


def cell(tau: float | None, error: float | None) -> str | float:
    """A table cell: τ, with its standard error when known ("-" for a missing run)."""
    if tau is None:
        return "-"
    return tau if error is None else f"{tau:.2f} ± {error:.2f}"


def plot(args, taus: dict, errors: dict, columns: list) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping ablation.png (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(taus)
    for i, (label, values) in enumerate(taus.items()):
        xs = [j + i * width for j in range(len(columns))]
        ax.bar(xs, [values.get(c, 0) for c in columns], width, label=label,
               yerr=[errors.get(label, {}).get(c, 0) for c in columns], capsize=2)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(columns))])
    ax.set_xticklabels([f"{b}\nT={t:g}" for b, t in columns])
    ax.set_ylabel("acceptance length τ")
    ax.set_title("Draft heads on SmolLM2-135M-Instruct (same data and budget)")
    top = max(v for values in taus.values() for v in values.values())
    ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.tight_layout()
    atomic_write(Path(args.report).with_suffix(".png"), lambda p: fig.savefig(p, format="png", dpi=120))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if args.run:
        (run_missing_replays if args.replay else run_missing)(args, temperatures)
    text = report(args, temperatures)
    atomic_write_text(Path(args.report), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
