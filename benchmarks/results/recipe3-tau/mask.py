"""What the alignment mask does on the EAGLE-3 base: eagle3 and griffin3 scored per pass under a top-3 mask (issue 33).

    python benchmarks/results/recipe3-tau/mask.py            # build the stores if missing, evaluate (resumes), tabulate
    python benchmarks/results/recipe3-tau/mask.py --table    # only the table, from the files

griffin3 trains with GRIFFIN's alignment mask: a position stays in pass i+1's loss only while the head's earlier passes
kept the target's token in their top-3. eagle3 trains every pass on every position. Scoring both heads the same way,
with the mask (``training.evaluate --steps 7 --topk 3``), splits what a tree needs at depth i into two measured parts:

- ``kept`` at pass i: the fraction of positions whose passes 1..i-1 all held the target's token in their top-3, i.e.
  how often a top-3 tree still has the right branch at depth i;
- ``top-1`` at pass i over those kept positions: how often the head's first guess there is right.

Their product is the fraction of positions where the head's top-1 chain reaches depth i through top-3 branches, the
quantity the mask is meant to raise. Both heads are the committed ``wip-*`` heads (fp16) of
``checkpoints/smollm2-135m-instruct-recipe3``; the stores are the recipe's fixed validation sets, rebuilt from the
records beside the heads if missing (``training.build_features``, as ``training.recipe`` builds them). Writes
``mask/<head>-<set>.json`` (the ``training.evaluate`` reports) and ``mask.{json,md}`` beside this file.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from griffin.report import machine_info, markdown_table, write_benchmark

HERE = Path("benchmarks/results/recipe3-tau")  # run from the repository root: the paths below are relative to it
RECIPE = Path("checkpoints/smollm2-135m-instruct-recipe3")
HEADS = {"eagle3": RECIPE / "wip-eagle3", "griffin3": RECIPE / "wip-griffin3"}
SETS = ("sharegpt", "regen")  # the recipe's two fixed sets: ShareGPT turns and the target's own answers
STEPS, TOPK = 7, 3


def store(name: str) -> Path:
    """The recipe's fixed validation store ``work/recipe3/fixed-val-<name>``, built from its records if missing."""
    path = Path("work/recipe3") / f"fixed-val-{name}"
    if not (path / "build.json").is_file():
        records = RECIPE / f"fixed-val-{name}.jsonl"
        subprocess.run([sys.executable, "-m", "training.build_features", "--data", str(records),
                        "--out", str(path), "--target", "smollm2-135m-instruct", "--max-len", "1024", "--dtype", "fp32",
                        "--feature-layers", "auto"], check=True)
    return path


def evaluate_command(head: str, name: str) -> list[str]:
    return ["python", "-m", "training.evaluate", str(HEADS[head]), "--features", str(Path("work/recipe3") /
            f"fixed-val-{name}"), "--steps", str(STEPS), "--topk", str(TOPK), "--mixed-precision", "no",
            "--out", str(HERE / "mask" / f"{head}-{name}.json")]


def run() -> None:
    for name in SETS:
        store(name)
        for head in HEADS:
            command = evaluate_command(head, name)
            if not Path(command[-1]).is_file():
                subprocess.run([sys.executable, *command[1:]], check=True)


def table() -> None:
    reports = {(head, name): json.loads((HERE / "mask" / f"{head}-{name}.json").read_text())
               for head in HEADS for name in SETS}
    rows = []
    for name in SETS:
        passes = {head: reports[(head, name)]["passes"] for head in HEADS}
        for i in range(STEPS):
            e, g = passes["eagle3"][i], passes["griffin3"][i]
            rows.append([name, i + 1, f"{e['kept']:.3f}", f"{g['kept']:.3f}", f"{e['top1']:.3f}", f"{g['top1']:.3f}",
                         f"{e['kept'] * e['top1']:.4f}", f"{g['kept'] * g['top1']:.4f}",
                         f"{g['kept'] * g['top1'] / (e['kept'] * e['top1']):.2f}", e["positions"], g["positions"]])
    headers = ["set", "pass", "kept eagle3", "kept griffin3", "top-1 eagle3", "top-1 griffin3",
               "reach eagle3", "reach griffin3", "reach griffin3 / eagle3", "positions eagle3", "positions griffin3"]
    conversations = {name: reports[("eagle3", name)]["conversations"] for name in SETS}
    trained = {head: json.loads((path / "stages.json").read_text()) for head, path in HEADS.items()}
    seen = ", ".join(f"{head} {len(stages)} chunks, {sum(e['tokens'] for s in stages for e in s['epochs']):,} tokens"
                     for head, stages in trained.items())
    text = ("# The alignment mask on the EAGLE-3 base: eagle3 and griffin3 scored alike\n\n"
            f"Both committed `wip-*` heads ({seen}), scored with `training.evaluate --steps {STEPS} "
            f"--topk {TOPK}` on the recipe's fixed validation sets ({conversations['sharegpt']} ShareGPT and "
            f"{conversations['regen']} answer conversations). `kept` at pass i: positions whose passes 1..i-1 all held "
            "the target's token in their top-3; `top-1`: accuracy over the kept positions; `reach` = kept x top-1, the "
            "positions where the head's first guess at depth i is right with every earlier depth's right token among "
            "its top-3.\n\n" + markdown_table(headers, rows) + "\n\nCommands (after `python -m training.build_features "
            "--data checkpoints/smollm2-135m-instruct-recipe3/fixed-val-<set>.jsonl --out work/recipe3/fixed-val-<set> "
            "--target smollm2-135m-instruct --max-len 1024 --dtype fp32 --feature-layers auto`):\n\n"
            + "".join(f"- `{' '.join(evaluate_command(head, name))}`\n" for name in SETS for head in HEADS))
    result = {"steps": STEPS, "topk": TOPK, "heads": {h: str(p) for h, p in HEADS.items()},
              "reports": {f"{head}-{name}": report for (head, name), report in reports.items()},
              "command": "python benchmarks/results/recipe3-tau/mask.py", "machine": machine_info()}
    write_benchmark(HERE, "mask", result, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="only the table, from the evaluation files")
    args = parser.parse_args()
    if not args.table:
        run()
    table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
