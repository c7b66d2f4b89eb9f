"""Which of GRIFFIN's two draft-model parts pays on the EAGLE-3 base: Token-Guided Fusion and dual heads, trained apart
(issue 33).

    python benchmarks/results/recipe3-tau/parts.py --arms eagle3,tgf &   # two processes, one arm each at a time
    python benchmarks/results/recipe3-tau/parts.py --arms dual,griffin3
    python benchmarks/results/recipe3-tau/parts.py --tau --limit 20      # then: τ of the four on MT-Bench T=0
    python benchmarks/results/recipe3-tau/parts.py --table               # only the table, from the files

``factorial.py`` took griffin3 apart into its architecture and its alignment mask: the mask costs at pass 1 and the
architecture pays, so the recipe trains griffin3 without the mask. This study takes the architecture apart: the four
heads with and without Token-Guided Fusion and dual heads (``train --no-tgf`` / ``--no-dual-heads``; eagle3 has
neither), all without the mask, trained from scratch on one ShareGPT shard of the recipe's three-layer store with
``factorial.py``'s settings, then scored as there (``training.evaluate --steps 7 --topk 3`` on the recipe's fixed
validation sets: top-1 at pass 1, reach kept x top-1 at passes 2-5) and by their offline τ on the ablation's 24-node
tree, MT-Bench T=0 (``inference.tau``, paired per prompt). Writes ``parts/<arm>-<set>.json``, ``parts/tau.*`` and
``parts.{json,md}`` beside this file; the heads go to ``work/parts/``. Each step resumes.
"""

import argparse
import json
import sys
from pathlib import Path

from factorial import SETS, SHAREGPT, reach, run  # the sibling study (this folder is on sys.path when run)

from griffin.draft import DraftModel
from griffin.io import atomic_write_json
from griffin.report import machine_info, markdown_table, paired_difference, pooled_tau, write_benchmark

HERE = Path("benchmarks/results/recipe3-tau")  # run from the repository root: the paths below are relative to it
OUT = HERE / "parts"
WORK = Path("work/parts")
SHARD = 52  # the first shard of chunk 26, the recipe's chunk when this study ran
ARMS = {  # name -> (arch, extra training flags, Token-Guided Fusion, dual heads)
    "eagle3": ("eagle3", [], False, False),
    "tgf": ("griffin3", ["--no-dual-heads"], True, False),
    "dual": ("griffin3", ["--no-tgf"], False, True),
    "griffin3": ("griffin3", [], True, True),
}
TRAIN = ["--topk", "0", "--ttt-steps", "7", "--lr", "1e-3", "--epochs", "1", "--batch-size", "4", "--draft-vocab",
         "8192", "--mixed-precision", "no", "--save-every", "20"]
TAU = ["--bench", "mt_bench", "--temperatures", "0", "--max-new-tokens", "128", "--depth", "5", "--top-k", "8",
       "--total-tokens", "24", "--draft-dtype", "fp32"]


def features() -> Path:
    """A store of the one shard (a view linking the recipe's shard), built first if the recipe has not."""
    from training.store import BUILD, MANIFEST, shard_name, write_manifest

    view = WORK / "features"
    if (view / MANIFEST).is_file():
        return view
    if not (SHAREGPT / shard_name(SHARD)).is_file():
        run(["-m", "training.build_features", "--data", "sharegpt", "--out", str(SHAREGPT), "--shards",
             f"{SHARD}:{SHARD + 1}", "--shard-size", "256", "--target", "smollm2-135m-instruct", "--max-len", "1024",
             "--dtype", "fp32", "--feature-layers", "auto"])
    view.mkdir(parents=True, exist_ok=True)
    (view / shard_name(0)).unlink(missing_ok=True)
    (view / shard_name(0)).hardlink_to((SHAREGPT / shard_name(SHARD)).resolve())  # outlives the recipe's clean-up
    build = json.loads((SHAREGPT / BUILD).read_text()) | {"max_samples": None, "data": f"sharegpt shard {SHARD}"}
    atomic_write_json(view / BUILD, build)
    write_manifest(view, build, [shard_name(0)])
    return view


def train_args(arm: str, store: Path) -> list[str]:
    arch, flags, _, _ = ARMS[arm]
    return ["-m", "training.train", "--features", str(store), "--out", str(WORK / arm), "--arch", arch, *flags, *TRAIN]


def evaluate_args(arm: str, name: str) -> list[str]:
    return ["-m", "training.evaluate", str(WORK / arm), "--features", f"work/recipe3/fixed-val-{name}", "--steps", "7",
            "--topk", "3", "--mixed-precision", "no", "--out", str(OUT / f"{arm}-{name}.json")]


def tau_args(threads: int = 1, limit: int | None = None) -> list[str]:
    return ["-m", "inference.tau", "--heads", *(str(WORK / arm) for arm in ARMS), *TAU, "--threads", str(threads),
            *(["--limit", str(limit)] if limit else []), "--out", str(OUT / "tau")]


def train(arms: list[str]) -> None:
    store = features()
    for arm in arms:
        if not (WORK / arm / "model.safetensors").is_file():
            resume = ["--resume"] if (WORK / arm).is_dir() else []
            run(train_args(arm, store) + resume)
        for name in SETS:
            if not (OUT / f"{arm}-{name}.json").is_file():
                run(evaluate_args(arm, name))


def scored(arm: str) -> bool:
    return all((OUT / f"{arm}-{name}.json").is_file() for name in SETS)


def tau_rows() -> tuple[list[list], dict]:
    """τ per arm and each arm against eagle3, paired per prompt, from the replay file (if it has been run)."""
    path = OUT / "tau.json"
    if not path.is_file():
        return [], {}
    replay = json.loads(path.read_text())
    prompts = {name: replay["heads"][name]["0"]["per_prompt"] for name in replay["heads"]}  # names: the arms
    rows, figures = [], {}
    for arm in ARMS:
        pooled = pooled_tau(prompts[arm])
        paired = paired_difference(prompts[arm], prompts["eagle3"]) if arm != "eagle3" else None
        figures[arm] = {**pooled, "minus_eagle3": paired}
        rows.append([arm, f"{pooled['tau']:.3f} ± {pooled['se']:.3f}",
                     "-" if paired is None else f"{paired['diff']:+.3f} ± {paired['se']:.3f}",
                     "-" if paired is None else f"{pooled['tau'] / (pooled['tau'] - paired['diff']):.3f}x"])
    return rows, figures


def table() -> None:
    """The table of the arms scored so far (an arm not trained yet is named below it)."""
    arms = [arm for arm in ARMS if scored(arm)]
    reports = {(arm, name): json.loads((OUT / f"{arm}-{name}.json").read_text()) for arm in arms for name in SETS}
    runs = {arm: json.loads((WORK / arm / "validation.json").read_text()) for arm in arms}  # one training each
    rows = []
    for arm in arms:
        _, _, tgf, dual = ARMS[arm]
        row = [arm, "yes" if tgf else "no", "yes" if dual else "no"]
        for name in SETS:
            passes = reports[(arm, name)]["passes"]
            row += [f"{passes[0]['top1']:.3f}", " ".join(f"{reach(p):.3f}" for p in passes[1:5])]
        row += [f"{DraftModel.from_pretrained(WORK / arm).num_parameters() / 1e6:.2f}",
                f"{runs[arm]['epochs'][-1].get('train_seconds', 0):.0f}"]
        rows.append(row)
    headers = ["arm", "Token-Guided Fusion", "dual heads", "top-1 pass 1 (ShareGPT)", "reach passes 2-5 (ShareGPT)",
               "top-1 pass 1 (answers)", "reach passes 2-5 (answers)", "parameters (M)", "train s (shared cores)"]
    tokens = {arm: sum(e["tokens"] for e in run["epochs"]) for arm, run in runs.items()}
    positions = {name: reports[(arms[0], name)]["passes"][0]["positions"] for name in SETS} if arms else {}
    tau, figures = tau_rows()
    text = ("# griffin3's architecture taken apart: Token-Guided Fusion and dual heads\n\n"
            f"Heads trained from scratch on one ShareGPT shard (shard {SHARD} of the recipe's store; "
            f"{', '.join(f'{a} {t:,}' for a, t in tokens.items())} tokens) with `factorial.py`'s settings "
            f"(`{' '.join(TRAIN)}`; no alignment mask), scored with `training.evaluate --steps 7 --topk 3` on the "
            "recipe's fixed validation sets (27 ShareGPT and 21 answer conversations, "
            f"{', '.join(f'{n:,} {s} positions' for s, n in positions.items())} at pass 1). Reach at pass i = "
            "kept x top-1: the positions where the head's first guess at depth i is right with every earlier "
            "depth's right token among its top-3 (`mask.md`).\n\n" + markdown_table(headers, rows)
            + "".join(f"\nNot trained yet: {arm} (`python benchmarks/results/recipe3-tau/parts.py --arms {arm}`).\n"
                      for arm in ARMS if arm not in arms))
    if tau:
        replay = json.loads((OUT / "tau.json").read_text())
        text += ("\n\nOffline τ on the ablation's tree (depth 5, top-k 8, 24 nodes), MT-Bench T=0, "
                 f"{replay['n_prompts']['0']} prompts, fp32 ([parts/tau.md](parts/tau.md)); each arm against "
                 "eagle3 paired per prompt (`griffin.report.paired_difference`):\n\n"
                 + markdown_table(["arm", "τ", "τ − eagle3's", "ratio"], tau))
    text += ("\n\nCommands:\n\n"
             + "".join(f"- `python {' '.join(train_args(arm, WORK / 'features'))}`\n" for arm in arms)
             + "".join(f"- `python {' '.join(evaluate_args(arm, name))}`\n" for arm in arms for name in SETS)
             + (f"- `{replay['command']}`\n" if tau else ""))
    result = {"arms": {arm: {"arch": ARMS[arm][0], "flags": ARMS[arm][1], "tgf": ARMS[arm][2],
                             "dual_heads": ARMS[arm][3]} for arm in arms},
              "shard": SHARD, "train": TRAIN, "tokens": tokens,
              "reports": {f"{arm}-{name}": r for (arm, name), r in reports.items()}, "tau": figures,
              "command": "python benchmarks/results/recipe3-tau/parts.py", "machine": machine_info()}
    write_benchmark(HERE, "parts", result, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="only the table, from the evaluation files")
    parser.add_argument("--tau", action="store_true", help="replay the four trained arms' τ (after training them)")
    parser.add_argument("--threads", type=int, default=1, help="--tau: torch threads of the replay")
    parser.add_argument("--limit", type=int, default=None, help="--tau: the first N questions (default: all 80)")
    parser.add_argument("--arms", default=",".join(ARMS), help="the arms to train and score here (comma-separated; "
                        "run two processes with different arms to use two cores)")
    args = parser.parse_args()
    if args.tau:
        run(tau_args(args.threads, args.limit))
    elif not args.table:
        train(args.arms.split(","))
    if any(scored(arm) for arm in ARMS):
        table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
