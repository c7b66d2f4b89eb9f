"""Should the recipe's griffin3 drop its alignment mask from now on? The committed heads continued apart (issue 33).

    python benchmarks/results/recipe3-tau/continuation.py                 # stores, trainings, scores, tau (resumes)
    python benchmarks/results/recipe3-tau/continuation.py --arms eagle3   # one arm here (another process: the rest;
                                                                          # the last to finish runs tau)
    python benchmarks/results/recipe3-tau/continuation.py --table         # only the table, from the files

``factorial.py`` found that, trained from scratch on one shard, griffin3's architecture beats eagle3's and its top-3
alignment mask costs pass-1 accuracy. The recipe's griffin3 has trained 10 chunks (5.01M tokens) with that mask. This
study asks whether switching the mask off now helps that head: it continues the committed chunk-9 heads
(``checkpoints/smollm2-135m-instruct-recipe3/wip-*``) as the recipe's chunk 10 would (its peak learning rate, one epoch,
fp32), on the first quarter of chunk 10 (ShareGPT shard 20), in three arms: griffin3 with the mask (what the recipe
does), griffin3 without it, and eagle3 (what griffin3 must beat). Each is scored as ``mask.py`` scores the committed
heads (``training.evaluate --steps 7 --topk 3`` on the fixed sets) and by tau on the 24-node tree (MT-Bench T=0, the
first 40 prompts). Writes ``continuation/`` (evaluation reports, the tau run) and ``continuation.{json,md}`` beside
this file; the heads go to ``work/continuation/``.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import factorial  # this folder's studies: the one-shard store
import mask  # the fixed validation stores and the committed heads

from griffin.report import machine_info, markdown_table, paired_difference, write_benchmark

HERE = Path("benchmarks/results/recipe3-tau")  # run from the repository root: the paths below are relative to it
OUT = HERE / "continuation"
WORK = Path("work/continuation")
LR = 1e-3 * 0.85 ** 10  # the recipe's peak rate of chunk 10 (stage 1, tenth chunk: training.recipe.schedule.peak_lr)
ARMS = {  # name -> (committed head it continues, arch, alignment mask top-k)
    "griffin3+mask": ("griffin3", "griffin3", 3),
    "griffin3-nomask": ("griffin3", "griffin3", 0),
    "eagle3": ("eagle3", "eagle3", 0),
}
TRAIN = ["--ttt-steps", "7", "--lr", f"{LR:.3g}", "--epochs", "1", "--batch-size", "4", "--draft-vocab", "8192",
         "--mixed-precision", "no", "--save-every", "20"]
TAU = ["--bench", "mt_bench", "--temperatures", "0", "--limit", "40", "--threads", "1", "--max-new-tokens", "128",
       "--depth", "5", "--top-k", "8", "--total-tokens", "24"]


def run(args: list[str]) -> None:
    print("$ python " + " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], check=True)


def train_args(arm: str, store: Path) -> list[str]:
    source, arch, topk = ARMS[arm]
    return ["-m", "training.train", "--features", str(store), "--out", str(WORK / arm), "--arch", arch, "--topk",
            str(topk), "--init-from", str(mask.HEADS[source]), *TRAIN]


def evaluate_args(arm: str, name: str) -> list[str]:
    return ["-m", "training.evaluate", str(WORK / arm), "--features", f"work/recipe3/fixed-val-{name}", "--steps", "7",
            "--topk", "3", "--mixed-precision", "no", "--out", str(OUT / f"{arm}-{name}.json")]


def tau_args() -> list[str]:
    return ["-m", "inference.tau", "--heads", *(str(WORK / arm) for arm in ARMS), *TAU, "--out", str(OUT / "tau")]


def train(arms: list[str]) -> None:
    for name in mask.SETS:
        mask.store(name)
    store = factorial.features()
    for arm in arms:
        if not (WORK / arm / "model.safetensors").is_file():
            run(train_args(arm, store) + (["--resume"] if (WORK / arm / "train_state").is_dir() else []))
        for name in mask.SETS:
            if not (OUT / f"{arm}-{name}.json").is_file():
                run(evaluate_args(arm, name))


def scored(arm: str) -> bool:
    return all((OUT / f"{arm}-{name}.json").is_file() for name in mask.SETS)


def table() -> None:
    """The table of the arms scored so far, with tau where the three heads' run exists."""
    arms = [arm for arm in ARMS if scored(arm)]
    reports = {(arm, name): json.loads((OUT / f"{arm}-{name}.json").read_text()) for arm in arms for name in mask.SETS}
    before = {(head, name): json.loads((HERE / "mask" / f"{head}-{name}.json").read_text())
              for head in mask.HEADS for name in mask.SETS}
    tau_file = OUT / "tau.json"
    tau = json.loads(tau_file.read_text()) if tau_file.is_file() else None
    rows = []
    for head in mask.HEADS:  # the committed heads, scored by mask.py the same way
        rows.append([f"{head} (chunk 9, committed)", "-"] + cells({n: before[(head, n)] for n in mask.SETS}) + ["", ""])
    for arm in arms:
        taus = tau_of(tau, arm) if tau else ""
        run = json.loads((WORK / arm / "validation.json").read_text())
        seconds = f"{run['epochs'][-1]['train_seconds']:.0f}"
        rows.append([arm, "top-3" if ARMS[arm][2] else "none"] + cells({n: reports[(arm, n)] for n in mask.SETS})
                    + [taus, seconds])
    headers = ["head", "training mask", "top-1 pass 1 (ShareGPT)", "reach passes 2-5 (ShareGPT)",
               "top-1 pass 1 (answers)", "reach passes 2-5 (answers)", "tau MT-Bench T=0, 40 prompts",
               "train s (shared cores)"]
    text = ("# griffin3 after 5.01M tokens with its alignment mask: continued with it, without it, and eagle3\n\n"
            f"The committed chunk-9 heads continued on ShareGPT shard {factorial.SHARD} of the recipe's store (the "
            f"first quarter of its chunk 10) with `{' '.join(TRAIN)}` (chunk 10's peak rate), then scored with "
            "`training.evaluate --steps 7 --topk 3` on the recipe's fixed validation sets (27 ShareGPT and 21 answer "
            "conversations) as `mask.md` scores the committed heads. Reach at pass i = kept x top-1.\n\n"
            + markdown_table(headers, rows)
            + (paired(tau) if tau else "\ntau not run yet.\n")
            + "\n\nCommands:\n\n"
            + "".join(f"- `python {' '.join(train_args(arm, WORK / 'features'))}`\n" for arm in arms)
            + "".join(f"- `python {' '.join(evaluate_args(arm, name))}`\n" for arm in arms for name in mask.SETS)
            + f"- `python {' '.join(tau_args())}`\n")
    result = {"arms": {arm: dict(zip(("from", "arch", "topk"), ARMS[arm])) for arm in arms}, "train": TRAIN,
              "reports": {f"{arm}-{name}": r for (arm, name), r in reports.items()}, "tau": tau,
              "command": "python benchmarks/results/recipe3-tau/continuation.py", "machine": machine_info()}
    write_benchmark(HERE, "continuation", result, text)


def cells(reports: dict[str, dict]) -> list[str]:
    out = []
    for name in mask.SETS:
        passes = reports[name]["passes"]
        out += [f"{passes[0]['top1']:.3f}", " ".join(f"{factorial.reach(p):.3f}" for p in passes[1:5])]
    return out


def tau_of(tau: dict, arm: str) -> str:
    run = tau["heads"][arm]["0"]
    return f"{run['tau']:.3f} ± {run['tau_se']:.3f}"


def paired(tau: dict) -> str:
    """Paired tau differences between the arms (same prompts, same target continuations)."""
    lines = ["\nPaired tau differences (pooled tau, ± its standard error over prompts):\n\n"]
    for first, other in (("griffin3-nomask", "eagle3"), ("griffin3+mask", "eagle3"),
                         ("griffin3-nomask", "griffin3+mask")):
        d = paired_difference(tau["heads"][first]["0"]["per_prompt"], tau["heads"][other]["0"]["per_prompt"])
        lines.append(f"- {first} − {other}: {d['diff']:+.3f} ± {d['se']:.3f} ({d['n_prompts']} prompts)\n")
    return "".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="only the table, from the files")
    parser.add_argument("--arms", default=",".join(ARMS), help="the arms to train and score here (comma-separated)")
    args = parser.parse_args()
    if not args.table:
        train(args.arms.split(","))
        if all((WORK / arm / "model.safetensors").is_file() for arm in ARMS) and not (OUT / "tau.json").is_file():
            run(tau_args())
    if any(scored(arm) for arm in ARMS):
        table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
