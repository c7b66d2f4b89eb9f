"""The recipe's learning curve: validation top-1 of each head against training tokens seen, with a log-linear fit.

    python -m benchmarks.learning_curve
    python -m benchmarks.learning_curve --recipe benchmarks/results/recipe/recipe.json --target 0.60
    python -m benchmarks.learning_curve --recipe benchmarks/results/recipe/recipe.json \
        checkpoints/smollm2-135m-instruct-recipe3/recipe.json        # the EAGLE-3 generation beside the shipped heads

Reads the ``recipe.json`` that ``training.recipe`` commits beside its heads (several: their curves side by side; by
default the shipped heads' and, while it trains, the EAGLE-3 generation's; no model is run) and writes
``benchmarks/results/learning-curve.{json,md,png}``: top-1 at pass 1 on the recipe's two fixed validation sets after
every chunk, GRIFFIN's ratio to EAGLE at the same tokens, and per head and set a least-squares fit
``top1 = a + b * ln(tokens)`` over the points after ``--fit-from`` tokens. A head forked from a stage-1 head at stage 2
is fitted over its lineage: the parent's points before the fork, then its own. The fit's tokens for ``--target`` top-1
is an extrapolation of the curve so far, labelled as such: it says whether data at this rate could reach the target,
not that it will. Beside it, the mean change of top-1 that a chunk of each kind (ShareGPT, the target's answers) made
over the same points: the two kinds pull the fixed sets in opposite directions, so the fit alone hides what each
adds.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy

from griffin.cli import run_cli
from griffin.io import read_json
from griffin.report import command_line, markdown_table, write_benchmark

DEFAULT_RECIPE = "benchmarks/results/recipe/recipe.json"
RECIPE3 = "checkpoints/smollm2-135m-instruct-recipe3/recipe.json"  # training.recipe --generation 3, while it trains
# a GRIFFIN head and the EAGLE head with its data and budget
PAIRS = {"griffin-s1": "eagle-s1", "griffin": "eagle2", "griffin3": "eagle3"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.learning_curve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", nargs="+", help="recipe.json files of training.recipe (default: the shipped heads' "
                   "record, and the EAGLE-3 generation's where it exists)")
    p.add_argument("--target", type=float, default=0.60, help="the top-1 whose tokens the fit extrapolates to")
    p.add_argument("--fit-from", type=int, default=1_000_000, help="fit only points after this many tokens")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--stem", default="learning-curve")
    args = p.parse_args(argv)
    args.argv = argv
    if args.recipe is None:
        args.recipe = [DEFAULT_RECIPE] + ([RECIPE3] if Path(RECIPE3).is_file() else [])
    return args


def fit(points: list[tuple[int, float]]) -> dict | None:
    """Least squares ``top1 = a + b ln(tokens)`` -> a, b, and the tokens per doubling's gain; None under 3 points."""
    if len(points) < 3:
        return None
    b, a = numpy.polyfit([math.log(t) for t, _ in points], [y for _, y in points], 1)
    return {"a": float(a), "b": float(b), "per_doubling": float(b) * math.log(2), "points": len(points)}


def tokens_for(line: dict, top1: float) -> float | None:
    """Tokens at which the fitted line reaches ``top1`` (None if it never rises)."""
    return math.exp((top1 - line["a"]) / line["b"]) if line["b"] > 0 else None


def lineage(state: dict, heads: dict[str, dict], head: str, kind: str) -> list[dict]:
    """``head``'s points on one fixed set, after its parent's points before its first chunk (recipe.json's
    ``forked_from``: a stage-2 head continues its stage-1 head)."""
    own = heads[head].get(kind, [])
    parent = state.get("heads", {}).get(head, {}).get("forked_from")
    if not parent or parent not in heads or not own:
        return own
    return [p for p in lineage(state, heads, parent, kind) if p["chunk"] < own[0]["chunk"]] + own


def gain_by_kind(points: list[dict], kinds: dict[int, str]) -> dict[str, float]:
    """Mean change of top-1 over the chunks of each kind -> {"sharegpt": ..., "regen": ...} (consecutive points)."""
    changes: dict[str, list[float]] = {}
    for before, after in zip(points, points[1:]):
        if after["chunk"] == before["chunk"] + 1 and after["chunk"] in kinds:
            changes.setdefault(kinds[after["chunk"]], []).append(after["top1"] - before["top1"])
    return {kind: sum(c) / len(c) for kind, c in changes.items()}


def curve(state: dict, fit_from: int, target: float) -> dict:
    chunk_kinds = {t["chunk"]: t["kind"] for t in state.get("timings", [])}
    heads: dict[str, dict] = {}
    for point in state["curve"]:
        for kind, passes in point.get("fixed", {}).items():
            first = next((p["top1"] for p in passes if p["pass"] == 1 and p["top1"] is not None), None)
            if first is not None:
                heads.setdefault(point["head"], {}).setdefault(kind, []).append(
                    {"chunk": point["chunk"], "tokens": point["tokens_seen"], "top1": first})
    fits = {}
    for head, kinds in heads.items():
        for kind in kinds:
            points = [p for p in lineage(state, heads, head, kind) if p["tokens"] > fit_from]
            line = fit([(p["tokens"], p["top1"]) for p in points])
            if line:
                line["tokens_for_target"] = tokens_for(line, target)
                line["gain_by_kind"] = gain_by_kind(points, chunk_kinds)
                fits.setdefault(head, {})[kind] = line
    ratios = []
    for mine, theirs in PAIRS.items():
        for kind, points in heads.get(mine, {}).items():
            other = {p["chunk"]: p["top1"] for p in heads.get(theirs, {}).get(kind, [])}
            ratios += [{"heads": f"{mine}/{theirs}", "set": kind, "chunk": p["chunk"], "tokens": p["tokens"],
                        "ratio": p["top1"] / other[p["chunk"]]} for p in points if other.get(p["chunk"])]
    return {"heads": heads, "fits": fits, "ratios": ratios, "target": target, "fit_from": fit_from}


def table(result: dict) -> str:
    rows = []
    for head, kinds in result["heads"].items():
        for kind, points in kinds.items():
            last = points[-1]
            line = result["fits"].get(head, {}).get(kind)
            reach = line and line["tokens_for_target"]
            gains = line["gain_by_kind"] if line else {}
            rows.append([head, kind, f"{len(points)} ({line['points'] if line else 0})", f"{last['tokens']:,}",
                         f"{last['top1']:.3f}",
                         f"{line['per_doubling']:+.3f}" if line else "-",
                         f"{reach / 1e6:,.0f}M" if reach else "-",
                         *(f"{gains[k]:+.4f}" if k in gains else "-" for k in ("sharegpt", "regen"))])
    latest: dict[tuple[str, str], dict] = {}
    for r in result["ratios"]:
        latest[r["heads"], r["set"]] = r
    ratio_rows = [[heads, kind, r["chunk"], f"{r['tokens']:,}", f"{r['ratio']:.3f}x"]
                  for (heads, kind), r in latest.items()]
    return ("# Learning curve of the recipe's heads\n\n"
            "Validation top-1 at pass 1 on the recipe's fixed sets after every chunk ("
            + ", ".join(f"`{r}`" for r in result["recipe"]) + "). "
            f"Fit: least squares `top1 = a + b ln(tokens)` over the points after {result['fit_from']:,} tokens, a "
            "stage-2 head's after its stage-1 parent's before the fork; "
            f"'tokens for {result['target']:.2f}' extrapolates that line (an estimate from the curve so far, not "
            "a measurement). The last two columns: the mean change of top-1 made by one chunk of ShareGPT "
            "conversations and by one chunk of the target's answers, over the same points.\n\n"
            + markdown_table(["head", "fixed set", "points (fitted)", "tokens seen", "top-1 now",
                              "top-1 gain per doubling (fit)", f"tokens for {result['target']:.2f} (fit)",
                              "change per ShareGPT chunk", "change per answers chunk"], rows)
            + "\nGRIFFIN against EAGLE at the same chunk (same data and budget), latest point:\n\n"
            + markdown_table(["heads", "fixed set", "chunk", "tokens seen", "top-1 ratio"], ratio_rows)
            + ("\n![learning curve](learning-curve.png)\n" if result.get("plot") else "")
            + f"\nCommand: `{result['command']}`\n")


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib)")
        return False
    kinds = sorted({kind for kinds in result["heads"].values() for kind in kinds})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for head, sets in result["heads"].items():
            points = sets.get(kind, [])
            if points:
                ax.plot([p["tokens"] for p in points], [p["top1"] for p in points], marker="o", ms=3, label=head)
        ax.set_xscale("log")
        ax.set_xlabel("training tokens seen")
        ax.set_ylabel("top-1 at pass 1")
        ax.set_title(f"fixed {kind}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    states = [read_json(path, "recipe state") for path in args.recipe]
    for path, state in zip(args.recipe, states):
        if not isinstance(state, dict) or not state.get("curve"):
            raise ValueError(f"{path} has no learning curve yet: run python -m training.recipe first")
    # one record of every head: the generations' head names differ, and they share the chunks
    merged = {"curve": [p for s in states for p in s["curve"]], "heads": {k: v for s in states for k, v in
                                                                          s.get("heads", {}).items()},
              "timings": states[0].get("timings", [])}
    result = curve(merged, args.fit_from, args.target)
    result.update(recipe=args.recipe, command=command_line("benchmarks.learning_curve", args.argv))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result["plot"] = plot(result, out / f"{args.stem}.png")
    write_benchmark(out, args.stem, result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
