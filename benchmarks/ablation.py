"""The GRIFFIN paper's ablation on our target: acceptance length of the five heads trained on the same data and budget,
beside the EAGLE-3-generation heads (``eagle3``, ``griffin3``) that ``training.recipe --generation 3`` trains.

    python -m benchmarks.ablation --run --replay  # offline replays (inference.tau) of every head, then the report
    python -m benchmarks.ablation --run          # speed runs of the real engine (our generator only), then the report
    python -m benchmarks.ablation                # only rebuild the report from existing results

Heads are ``checkpoints/<target>-<name>`` for the names below; every head uses the same tree and generation settings.
Columns: MT-Bench, HumanEval and GSM8K at each temperature, and the extra task types (translation, summarisation,
questions over a passage) at T=0.
Only runs of a head's present weights count (the weights digest each run records).
Two sources of τ, the same quantity (:mod:`inference.tau` says why): ``--replay`` replays every head's
drafting against the target's stored continuations (:mod:`inference.tau`: one target forward per prompt for all the
heads it runs, minutes instead of hours), files ``tau-<bench>-T<temp>.json``; heads added later (or retrained) replay
in a file of their own, ``tau-<bench>-T<temp>-<name>.json``, beside a rerun of GRIFFIN, so that each head is paired with
a GRIFFIN run of the same machine and draft dtype. Without ``--replay``, speed runs of the generator, files
``<bench>-<target>-<head>-T<temp>.json``. Either goes to ``benchmarks/results/ablation/``; the report to
``benchmarks/results/ablation.md`` (table of τ, and GRIFFIN against each head paired over the same prompts) and
``ablation.png`` (plot).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from griffin.cli import run_cli
from griffin.io import atomic_write, atomic_write_text, weights_digest
from griffin.report import markdown_table, paired_difference, pooled_tau
from inference.questions import BENCHES, EXTRA_BENCHES
from training.export import STAGES

HEADS = {  # label -> checkpoint suffix; arch, K and top-k of each in the model cards
    "GRIFFIN": "griffin",
    "w/o TAT (griffin, K=1)": "griffin-k1",
    "w/o TAD (eagle, K=3, top-3 mask)": "eagle-tat",
    "HASS (eagle, K=3, no mask)": "hass",
    "EAGLE-2 (eagle, K=1)": "eagle2",
    "EAGLE-3 (eagle3, TTT 7)": "recipe3/wip-eagle3",
    "GRIFFIN on EAGLE-3 (griffin3, TTT 7)": "recipe3/wip-griffin3",
}
BASELINE = "EAGLE-2 (eagle, K=1)"
OURS = "GRIFFIN"
NEW_BASE = ("EAGLE-3 (eagle3, TTT 7)", "GRIFFIN on EAGLE-3 (griffin3, TTT 7)")  # (reference, head)


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
    p.add_argument("--benches", default=",".join(BENCHES + EXTRA_BENCHES),
                   help="benches to run (the report shows all it finds; the extra task types at T=0 only)")
    p.add_argument("--heads", default=",".join(HEADS.values()),
                   help="comma-separated checkpoint suffixes to run (the report shows all it finds; speed runs: "
                        "split them over several processes to use more cores)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the replays")
    return p.parse_args(argv)


def run_limit(args, bench: str, temperature: float) -> int | None:
    if args.limit is not None:
        return args.limit
    return None if (bench == "mt_bench" and temperature == 0) or bench in EXTRA_BENCHES else 20


def columns_of(benches: list[str], temperatures: list[float]) -> list[tuple[str, float]]:
    """The table's columns: every bench at every temperature, the extra task types (greedy tasks) at T=0 only."""
    return [(b, t) for t in temperatures for b in benches if b not in EXTRA_BENCHES or t == 0]


def head_folder(args, suffix: str) -> Path:
    return Path(args.checkpoints) / f"{args.target}-{suffix}"


def result_path(args, bench: str, suffix: str, temperature: float) -> Path:
    return Path(args.results) / f"{bench}-{args.target}-{suffix.replace('/', '-')}-T{temperature:g}.json"


def replay_path(args, bench: str, temperature: float, tag: str = "") -> Path:
    return Path(args.results) / f"tau-{bench}-T{temperature:g}{'-' + tag if tag else ''}.json"


def replay_files(args, bench: str, temperature: float) -> list[Path]:
    """The replay files of one column: the first run's file, then those of heads added later."""
    first = replay_path(args, bench, temperature)
    later = sorted(Path(args.results).glob(f"{first.stem}-*.json"))
    return ([first] if first.is_file() else []) + later


def tree_argv(args, bench: str, temperature: float) -> list[str]:
    argv = ["--max-new-tokens", str(args.max_new_tokens), "--depth", str(args.depth), "--top-k", str(args.top_k),
            "--total-tokens", str(args.total_tokens)]
    limit = run_limit(args, bench, temperature)
    return argv + (["--limit", str(limit)] if limit is not None else [])


def run_missing(args, temperatures: list[float]) -> None:
    from inference import speed

    for suffix in args.heads.split(","):
        head = head_folder(args, suffix)
        for bench, temperature in columns_of(args.benches.split(","), temperatures):
            if result_path(args, bench, suffix, temperature).is_file():
                continue
            speed.main(["--bench", bench, "--draft", str(head), "--methods", "ours", "--temperature",
                        str(temperature), "--out-dir", args.results, *tree_argv(args, bench, temperature)])


def run_missing_replays(args, temperatures: list[float]) -> None:
    """One replay per bench and temperature with every head it lacks at once (the target's forward is shared); a
    column that already has a file gets a second one, with GRIFFIN rerun in it as the pairing reference."""
    from inference import tau

    suffixes = args.heads.split(",")
    for bench, temperature in columns_of(args.benches.split(","), temperatures):
        present = {name for path in replay_files(args, bench, temperature)
                   for name, digest in json.loads(path.read_text()).get("head_digests", {}).items()
                   if any(head_folder(args, s).name == name and digest == head_digest(args, s) for s in suffixes)}
        missing = [s for s in suffixes if head_folder(args, s).name not in present]
        if not missing:
            continue
        path, n = replay_path(args, bench, temperature), 1
        while path.is_file():  # a new file: one that holds other heads' present runs must stay
            tag = missing[0].split("/")[0]
            path, n = replay_path(args, bench, temperature, tag if n == 1 else f"{tag}-{n}"), n + 1
        if n > 1:
            missing = [HEADS[OURS]] * (HEADS[OURS] not in missing) + missing
        tau.main(["--heads", *(str(head_folder(args, s)) for s in missing), "--bench", bench,
                  "--temperatures", f"{temperature:g}", "--threads", str(args.threads),
                  "--out", str(path.with_suffix("")), *tree_argv(args, bench, temperature)])


def head_digest(args, suffix: str) -> str | None:
    """The weights digest of a head's checkpoint (None where it is missing: none of its runs count)."""
    folder = head_folder(args, suffix)
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
    """The same as :func:`speed_runs`, read from the replay files (per column the first file, then those of heads
    added later; a head counts from the first file holding its present weights). Each run also carries ``reference``,
    GRIFFIN's run in the same file when there is one, and ``source``, the file's name, machine and draft dtype."""
    runs: dict[str, dict[tuple, dict]] = {}
    stale = []
    for bench, t in columns:
        for path in replay_files(args, bench, t):
            result = json.loads(path.read_text())
            found = {}
            for label, suffix in HEADS.items():
                name = head_folder(args, suffix).name
                run = result["heads"].get(name, {}).get(f"{t:g}")
                if run is None:
                    continue
                if result.get("head_digests", {}).get(name) != head_digest(args, suffix):
                    stale.append(f"{path.name} ({suffix})")
                    continue
                found[label] = {**run, "command": result["command"], "tree": result["tree"],
                                "max_new_tokens": result["max_new_tokens"],
                                "source": {"file": path.name, "machine": result.get("machine", {}).get("cpu", "?"),
                                           "draft_dtype": result.get("draft_dtype", "?"),
                                           "seconds": result.get("seconds")}}
            for label, run in found.items():
                if (bench, t) not in runs.get(label, {}):
                    runs.setdefault(label, {})[(bench, t)] = {**run, "reference": found.get(OURS)}
    return runs, stale


def tokens_trained(args, suffix: str) -> int | None:
    """Tokens a head has trained on, summed over the stages its checkpoint records (None where it records none)."""
    path = head_folder(args, suffix) / STAGES
    if not path.is_file():
        return None
    return sum(epoch.get("tokens", 0) for stage in json.loads(path.read_text()) for epoch in stage.get("epochs", []))


def report(args, temperatures: list[float]) -> str:
    columns = columns_of(list(BENCHES + EXTRA_BENCHES), temperatures)
    runs, stale = (replays if args.replay else speed_runs)(args, columns)
    if stale:
        print(f"left out {len(stale)} runs of other weights than the heads' present ones: {', '.join(stale)}")
    if not runs:
        raise FileNotFoundError(f"no ablation results under {args.results}: run with --run first"
                                + (" --replay" if args.replay else ""))
    taus = {label: {c: run["tau"] for c, run in found.items()} for label, found in runs.items()}
    errors = {label: {c: e for c, run in found.items()
                      if not math.isnan(e := pooled_tau(run.get("per_prompt", []))["se"])}
              for label, found in runs.items()}
    prompts: dict[tuple, set] = {}
    for found in runs.values():
        for c, run in found.items():
            prompts.setdefault(c, set()).add(run["n_prompts"])
    commands = {run["command"] for found in runs.values() for run in found.values()}
    settings = next((run["tree"], run["max_new_tokens"]) for found in runs.values() for run in found.values())
    columns = [c for c in columns if c in prompts]
    names = [f"{b} T={t:g} ({'/'.join(map(str, sorted(prompts[(b, t)])))})" for b, t in columns]
    headers = ["head", "tokens"] + names + ["mean", f"mean vs {BASELINE.split(' ')[0]}"]
    base = taus.get(BASELINE, {})
    rows = []
    for label in HEADS:
        if label not in taus:
            continue
        values = [taus[label].get(c) for c in columns]
        present = [v for v in values if v is not None]
        mean = sum(present) / len(present)
        ratios = [v / base[c] for v, c in zip(values, columns) if v is not None and c in base]
        tokens = tokens_trained(args, HEADS[label])
        rows.append([label, "-" if tokens is None else f"{tokens / 1e6:.2f}M"] +
                    [cell(v, errors.get(label, {}).get(c)) for v, c in zip(values, columns)] + [mean] +
                    [f"{sum(ratios) / len(ratios):.3f}x" if ratios else "-"])
    source = ("offline replays of each head's drafting against the target's stored continuations "
              "(`inference.tau`, whose docstring shows why that is the engine's τ)" if args.replay else
              "speed runs of the generator")
    text = ("# Ablation: acceptance length τ on SmolLM2-135M-Instruct\n\n"
            f"τ = new tokens per target forward pass, from {source}. `tokens`: what each head has trained on (the "
            "stages its checkpoint records); heads with the same count trained on the same features, data split and "
            "schedule (the first five: the GRIFFIN paper's ablation; the last two: `training.recipe --generation 3`, "
            f"still training). Tree {settings[0]}, up to {settings[1]} new tokens, fp32 target. Column headers give "
            "the number of prompts (MT-Bench: both turns of each question); τ is pooled over them (all new tokens / "
            "all passes) and ± is its standard error over prompts (delta method; at T=0 all heads answer the same "
            "prompts, so a difference between heads is less noisy than that: see the paired table).\n\n"
            + markdown_table(headers, rows))
    text += paired_section(runs, columns, names, OURS)
    text += paired_section({label: runs[label] for label in NEW_BASE if label in runs}, columns, names, NEW_BASE[1])
    text += sources_section(runs) if args.replay else ""
    text += (f"\nProduced by `python -m benchmarks.ablation{' --replay' if args.replay else ''}`, from these runs:\n\n"
             + "".join(f"- `{c}`\n" for c in sorted(commands)))
    plot(args, taus, errors, columns)
    return text


def paired_section(runs: dict[str, dict[tuple, dict]], columns: list[tuple], names: list[str], ours_label: str) -> str:
    """``ours_label`` minus each other head, per column, paired over the prompts both ran (empty without it). Against
    GRIFFIN a head pairs with the GRIFFIN run of its own replay file where there is one (same machine and dtype)."""
    ours = runs.get(ours_label, {})
    rows = []
    for label, found in runs.items():
        if label == ours_label:
            continue
        row = [label]
        for c in columns:
            own = found[c].get("reference") if c in found and ours_label == OURS else None
            reference = (own or ours.get(c)) if c in found else None
            pair = (paired_difference(reference.get("per_prompt", []), found[c].get("per_prompt", []))
                    if reference is not None else None)
            if pair is None:
                row.append("-")
                continue
            error = "" if math.isnan(pair["se"]) else f" ± {pair['se']:.3f}"
            row.append(f"{pair['diff']:+.3f}{error} ({reference['tau'] / found[c]['tau']:.3f}x)")
        rows.append(row)
    if not rows or all(v == "-" for row in rows for v in row[1:]):
        return ""
    against = "each head" if len(rows) > 1 else rows[0][0]
    return (f"\n## {ours_label} against {against}, paired\n\nOver the prompts both heads ran: "
            f"τ({ours_label}) − τ(head), ± its standard error (delta method, paired per prompt), and the ratio of "
            "the two τ"
            + (" (each head against the GRIFFIN run of its own replay file where it has one)" if ours_label == OURS
               else "") + ".\n\n" + markdown_table(["head"] + names, rows))


def sources_section(runs: dict[str, dict[tuple, dict]]) -> str:
    """Which replay file each column's heads come from, with its machine and draft dtype, and GRIFFIN's τ in each
    (where a column has several files, GRIFFIN's two τ show what the machine and dtype change)."""
    files: dict[str, dict] = {}
    for label, found in runs.items():
        for run in found.values():
            entry = files.setdefault(run["source"]["file"], {**run["source"], "heads": [], "griffin": None})
            entry["heads"].append(label)
            if run.get("reference") is not None:
                entry["griffin"] = run["reference"]["tau"]
    rows = [[f"`{name}`", entry["machine"], entry["draft_dtype"], ", ".join(entry["heads"]),
             "-" if entry["griffin"] is None else f"{entry['griffin']:.3f}",
             "-" if entry["seconds"] is None else f"{entry['seconds']:.0f}"] for name, entry in sorted(files.items())]
    return ("\n## Replay files\n\n" + markdown_table(["file", "machine", "draft dtype", "heads counted from it",
                                                        "GRIFFIN τ in it", "seconds"], rows))


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
        ax.bar(xs, [values.get(c, math.nan) for c in columns], width, label=label,  # a missing run: no bar
               yerr=[errors.get(label, {}).get(c, 0) for c in columns], capsize=2)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(columns))])
    ax.set_xticklabels([f"{b}\nT={t:g}" for b, t in columns])
    ax.set_ylabel("acceptance length τ")
    ax.set_title("Draft heads on SmolLM2-135M-Instruct (one tree; the tokens each trained on: ablation.md)")
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
