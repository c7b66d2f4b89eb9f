"""The GRIFFIN paper's ablation on our target: acceptance length of five heads trained on the same data and budget.

    python -m inference.ablation --run          # speed runs (our generator only) for every head, then the report
    python -m inference.ablation                # only rebuild the report from existing results

Heads are ``checkpoints/<target>-<name>`` for the names below; every head uses the same tree and generation settings.
The runs go to ``benchmarks/results/ablation/``; the report to ``benchmarks/results/ablation.md`` (table) and
``ablation.png`` (plot).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from griffin.io import atomic_write, atomic_write_text
from training.cli import run_cli

from .questions import BENCHES
from .report import markdown_table

HEADS = {  # label -> checkpoint suffix; arch, K and top-k of each in the model cards
    "GRIFFIN": "griffin",
    "w/o TAT (griffin, K=1)": "griffin-k1",
    "w/o TAD (eagle, K=3, top-3 mask)": "eagle-tat",
    "HASS (eagle, K=3, no mask)": "hass",
    "EAGLE-2 (eagle, K=1)": "eagle2",
}
BASELINE = "EAGLE-2 (eagle, K=1)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference.ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="store_true", help="run the missing speed runs first")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--checkpoints", default="checkpoints")
    p.add_argument("--results", default="benchmarks/results/ablation",
                   help="folder of the ablation's speed runs and report (apart from the headline runs, whose tree "
                        "may be tuned per head)")
    p.add_argument("--report", default="benchmarks/results/ablation.md", help="the table; the plot goes beside it")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--depth", type=int, default=5, help="one fixed tree for every head (not tuned per head)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--total-tokens", type=int, default=24)
    p.add_argument("--benches", default=",".join(BENCHES), help="benches to run (the report shows all it finds)")
    p.add_argument("--heads", default=",".join(HEADS.values()),
                   help="checkpoint suffixes to run (split them over several processes to use more cores)")
    return p.parse_args(argv)


def result_path(args, bench: str, suffix: str, temperature: float) -> Path:
    return Path(args.results) / f"{bench}-{args.target}-{suffix}-T{temperature:g}.json"


def run_missing(args, temperatures: list[float]) -> None:
    from . import speed

    for suffix in args.heads.split(","):
        head = Path(args.checkpoints) / f"{args.target}-{suffix}"
        for temperature in temperatures:
            for bench in args.benches.split(","):
                if result_path(args, bench, suffix, temperature).is_file():
                    continue
                argv = ["--bench", bench, "--draft", str(head), "--methods", "ours", "--temperature",
                        str(temperature), "--max-new-tokens", str(args.max_new_tokens), "--out-dir", args.results]
                for flag in ("limit", "depth", "top_k", "total_tokens"):
                    if getattr(args, flag) is not None:
                        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
                speed.main(argv)


def report(args, temperatures: list[float]) -> str:
    columns = [(b, t) for t in temperatures for b in BENCHES]
    taus: dict[str, dict] = {}
    errors: dict[str, dict] = {}  # standard error of the mean per-prompt τ
    prompts: dict[tuple, set] = {}
    commands = set()
    for label, suffix in HEADS.items():
        for bench, t in columns:
            path = result_path(args, bench, suffix, t)
            if path.is_file():
                result = json.loads(path.read_text())
                taus.setdefault(label, {})[(bench, t)] = result["tau"]
                per_prompt = [p["tau"] for p in result.get("per_prompt", [])]
                if len(per_prompt) > 1:
                    errors.setdefault(label, {})[(bench, t)] = statistics.stdev(per_prompt) / len(per_prompt) ** 0.5
                prompts.setdefault((bench, t), set()).add(result["n_prompts"])
                commands.add(result["command"])
                settings = (result["tree"], result["max_new_tokens"])
    if not taus:
        raise FileNotFoundError(f"no ablation results under {args.results}: run with --run first")
    columns = [c for c in columns if c in prompts]
    headers = (["head"] + [f"{b} T={t:g} ({'/'.join(map(str, sorted(prompts[(b, t)])))})" for b, t in columns] +
               ["mean", f"mean vs {BASELINE.split(' ')[0]}"])
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
    text = ("# Ablation: acceptance length τ on SmolLM2-135M-Instruct\n\n"
            f"τ = new tokens per target forward pass. Same features, data split and number of updates for every "
            f"head; tree {settings[0]}, up to {settings[1]} new tokens, fp32 target. Column headers give the number "
            "of prompts (MT-Bench: both turns of each question); ± is the standard error of the mean of per-prompt τ "
            "(the spread over prompts; at T=0 all heads answer the same prompts, so a difference between heads is "
            "less noisy than that).\n\n" + markdown_table(headers, rows) +
            "\nProduced by `python -m inference.ablation`, from these speed runs:\n\n" +
            "".join(f"- `{c}`\n" for c in sorted(commands)))
    plot(args, taus, errors, columns)
    return text


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
        run_missing(args, temperatures)
    text = report(args, temperatures)
    atomic_write_text(Path(args.report), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
