"""Which part of griffin3 costs at pass 1: its architecture or its alignment mask, trained apart (issue 33).

    python benchmarks/results/recipe3-tau/factorial.py            # features, four trainings, scores (each resumes)
    python benchmarks/results/recipe3-tau/factorial.py --table    # only the table, from the files

griffin3 differs from eagle3 in two ways: its architecture (Token-Guided Fusion and dual heads on the fused feature)
and its training (GRIFFIN's top-3 alignment mask over the training-time-test passes). After the recipe's 10 chunks it
trails eagle3 at pass 1 (``mask.md``), where both train on every position. This study trains the four combinations
from scratch on the same data with one schedule (one ShareGPT shard of 256 records, shard 20 of the recipe's store,
the recipe's first-chunk settings: lr 1e-3, one epoch, fp32) and scores each on the recipe's fixed validation sets
with ``training.evaluate --steps 7 --topk 3`` (as ``mask.py``), so that each part's effect on pass-1 accuracy and on
reach (kept x top-1 per pass) is measured at equal tokens. Writes ``factorial/<arm>-<set>.json`` (the evaluation
reports) and ``factorial.{json,md}`` beside this file; the heads go to ``work/factorial/``.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from griffin.io import atomic_write_json
from griffin.report import machine_info, markdown_table, write_benchmark

HERE = Path("benchmarks/results/recipe3-tau")  # run from the repository root: the paths below are relative to it
WORK = Path("work/factorial")
SHAREGPT = Path("work/features-sharegpt-3layers")  # the recipe's shared store (training.recipe --generation 3)
SHARD = 20
ARMS = {  # name -> (arch, alignment mask top-k)
    "eagle3": ("eagle3", 0),
    "eagle3+mask": ("eagle3", 3),
    "griffin3-nomask": ("griffin3", 0),
    "griffin3": ("griffin3", 3),
}
SETS = ("sharegpt", "regen")
TRAIN = ["--ttt-steps", "7", "--lr", "1e-3", "--epochs", "1", "--batch-size", "4", "--draft-vocab", "8192",
         "--mixed-precision", "no", "--save-every", "20"]


def run(args: list[str]) -> None:
    print("$ python " + " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], check=True)


def features() -> Path:
    """A store of the one shard (a view linking the recipe's shard), built first if the recipe has not."""
    from training.store import MANIFEST, link_view, shard_name

    view = WORK / "features"
    if (view / MANIFEST).is_file():
        return view
    if not (SHAREGPT / shard_name(SHARD)).is_file():
        run(["-m", "training.build_features", "--data", "sharegpt", "--out", str(SHAREGPT), "--shards",
             f"{SHARD}:{SHARD + 1}", "--shard-size", "256", "--target", "smollm2-135m-instruct", "--max-len", "1024",
             "--dtype", "fp32", "--feature-layers", "auto"])
    return link_view(SHAREGPT, [SHARD], view, f"sharegpt shard {SHARD}")


def train_args(arm: str, store: Path) -> list[str]:
    arch, topk = ARMS[arm]
    return ["-m", "training.train", "--features", str(store), "--out", str(WORK / arm), "--arch", arch, "--topk",
            str(topk), *TRAIN]


def evaluate_args(arm: str, name: str) -> list[str]:
    return ["-m", "training.evaluate", str(WORK / arm), "--features", f"work/recipe3/fixed-val-{name}", "--steps", "7",
            "--topk", "3", "--mixed-precision", "no", "--out", str(HERE / "factorial" / f"{arm}-{name}.json")]


def train(arms: list[str]) -> None:
    store = features()
    for arm in arms:
        if not (WORK / arm / "model.safetensors").is_file():
            resume = ["--resume"] if (WORK / arm).is_dir() else []
            run(train_args(arm, store) + resume)
        for name in SETS:
            if not (HERE / "factorial" / f"{arm}-{name}.json").is_file():
                run(evaluate_args(arm, name))


def reach(scores: dict) -> float:
    """kept x top-1 of one pass (no position kept: none reached; evaluate reports its top-1 as None)."""
    return scores["kept"] * (scores["top1"] or 0.0)


def scored(arm: str) -> bool:
    return all((HERE / "factorial" / f"{arm}-{name}.json").is_file() for name in SETS)


def table() -> None:
    """The table of the arms scored so far (an arm not trained yet is named below it)."""
    arms = [arm for arm in ARMS if scored(arm)]
    reports = {(arm, name): json.loads((HERE / "factorial" / f"{arm}-{name}.json").read_text())
               for arm in arms for name in SETS}
    runs = {arm: json.loads((WORK / arm / "validation.json").read_text()) for arm in arms}  # one training each
    rows = []
    for arm in arms:
        arch, topk = ARMS[arm]
        row = [arm, arch, f"top-{topk}" if topk else "none"]
        for name in SETS:
            passes = reports[(arm, name)]["passes"]
            row += [f"{passes[0]['top1']:.3f}", " ".join(f"{reach(p):.3f}" for p in passes[1:5])]
        epochs = runs[arm]["epochs"]
        row.append(f"{epochs[-1].get('train_seconds', 0):.0f}")
        rows.append(row)
    headers = ["arm", "architecture", "training mask", "top-1 pass 1 (ShareGPT)", "reach passes 2-5 (ShareGPT)",
               "top-1 pass 1 (answers)", "reach passes 2-5 (answers)", "train s (shared cores)"]
    tokens = {arm: sum(e["tokens"] for e in run["epochs"]) for arm, run in runs.items()}
    text = ("# griffin3's two parts trained apart: architecture and alignment mask\n\n"
            f"Heads trained from scratch on one ShareGPT shard (shard {SHARD} of the recipe's store; "
            f"{', '.join(f'{a} {t:,}' for a, t in tokens.items())} tokens) with the recipe's first-chunk settings "
            f"(`{' '.join(TRAIN)}`), scored with `training.evaluate --steps 7 --topk 3` on the recipe's fixed "
            "validation sets (27 ShareGPT and 21 answer conversations). Reach at pass i = kept x top-1: the "
            "positions where the head's first guess at depth i is right with every earlier depth's right token among "
            "its top-3 (`mask.md`).\n\n" + markdown_table(headers, rows)
            + "".join(f"\nNot trained yet: {arm} (`python benchmarks/results/recipe3-tau/factorial.py --arms {arm}`).\n"
                      for arm in ARMS if arm not in arms)
            + "\n\nCommands:\n\n"
            + "".join(f"- `python {' '.join(train_args(arm, WORK / 'features'))}`\n" for arm in arms)
            + "".join(f"- `python {' '.join(evaluate_args(arm, name))}`\n" for arm in arms for name in SETS))
    result = {"arms": {arm: {"arch": ARMS[arm][0], "topk": ARMS[arm][1]} for arm in arms}, "train": TRAIN,
              "tokens": tokens, "reports": {f"{arm}-{name}": r for (arm, name), r in reports.items()},
              "command": "python benchmarks/results/recipe3-tau/factorial.py", "machine": machine_info()}
    write_benchmark(HERE, "factorial", result, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="only the table, from the evaluation files")
    parser.add_argument("--arms", default=",".join(ARMS), help="the arms to train and score here (comma-separated; "
                        "run two processes with different arms to use two cores)")
    args = parser.parse_args()
    if not args.table:
        train(args.arms.split(","))
    if any(scored(arm) for arm in ARMS):
        table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
