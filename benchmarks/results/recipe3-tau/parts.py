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
RECIPE3 = Path("checkpoints/smollm2-135m-instruct-recipe3")  # the recipe's committed fixed validation conversations
SHARD = 52  # the first shard of chunk 26, the recipe's chunk when this study ran
ARMS = {  # name -> (arch, extra training flags, Token-Guided Fusion, dual heads)
    "eagle3": ("eagle3", [], False, False),
    "tgf": ("griffin3", ["--no-dual-heads"], True, False),
    "dual": ("griffin3", ["--no-tgf"], False, True),
    "griffin3": ("griffin3", [], True, True),
    # as wide as tgf: the draft layer's MLP widened by TGF's parameters, so that tgf's gain over eagle3 can be told
    # from its size (3 x 576 x 1921 = TGF's 3.32M parameters)
    "eagle3-wide": ("eagle3", ["--intermediate-size", "3457"], False, False),
}
TRAIN = ["--topk", "0", "--ttt-steps", "7", "--lr", "1e-3", "--epochs", "1", "--batch-size", "4", "--draft-vocab",
         "8192", "--mixed-precision", "no", "--save-every", "20"]
TAU = ["--bench", "mt_bench", "--temperatures", "0", "--max-new-tokens", "128", "--depth", "5", "--top-k", "8",
       "--total-tokens", "24", "--draft-dtype", "fp32"]


def features() -> Path:
    """A store of the one shard (a view linking the recipe's shard), built first if the recipe has not."""
    from training.store import BUILD, MANIFEST, link_view, shard_name

    view = WORK / "features"
    if (view / MANIFEST).is_file():
        return view
    source = SHAREGPT  # the recipe's store where it holds the shard in fp32, as on the machine the first arms ran
    if not ((SHAREGPT / shard_name(SHARD)).is_file()
            and json.loads((SHAREGPT / BUILD).read_text())["dtype"] == "float32"):
        source = WORK / "sharegpt-fp32"  # a bf16 store (a machine with bf16 steps) or a shard already trained on
        if not (source / shard_name(SHARD)).is_file():
            run(["-m", "training.build_features", "--data", "sharegpt", "--out", str(source), "--shards",
                 f"{SHARD}:{SHARD + 1}", "--shard-size", "256", "--target", "smollm2-135m-instruct", "--max-len",
                 "1024", "--dtype", "fp32", "--feature-layers", "auto"])
    return link_view(source, [SHARD], view, f"sharegpt shard {SHARD}", hard=True)  # outlives the recipe's clean-up


def train_args(arm: str, store: Path) -> list[str]:
    arch, flags, _, _ = ARMS[arm]
    return ["-m", "training.train", "--features", str(store), "--out", str(WORK / arm), "--arch", arch, *flags, *TRAIN]


def fixed_val(name: str) -> Path:
    """The recipe's fixed validation store ``name`` where it is fp32 (as the first arms were scored on), else one built
    here in fp32 from the committed conversations."""
    from training.store import BUILD, MANIFEST

    recipe = Path(f"work/recipe3/fixed-val-{name}")
    if (recipe / BUILD).is_file() and json.loads((recipe / BUILD).read_text())["dtype"] == "float32":
        return recipe
    store = WORK / f"fixed-val-{name}"
    if not (store / MANIFEST).is_file():
        run(["-m", "training.build_features", "--data", str(RECIPE3 / f"fixed-val-{name}.jsonl"), "--out", str(store),
             "--target", "smollm2-135m-instruct", "--max-len", "1024", "--dtype", "fp32", "--feature-layers", "auto"])
    return store


def evaluate_args(arm: str, name: str, store: Path) -> list[str]:
    return ["-m", "training.evaluate", str(WORK / arm), "--features", str(store),
            "--steps", "7", "--topk", "3", "--mixed-precision", "no", "--out", str(OUT / f"{arm}-{name}.json")]


def tau_args(arms: list[str], threads: int = 1, limit: int | None = None) -> list[str]:
    """The replay of ``arms``: into ``parts/tau`` for the first one, ``parts/tau-<arms>`` for arms trained later (the
    earlier heads may be gone; their per-prompt τ in the committed files pairs with the later ones')."""
    out = OUT / ("tau" if not tau_files() else "tau-" + "+".join(arms))
    return ["-m", "inference.tau", "--heads", *(str(WORK / arm) for arm in arms), *TAU, "--threads", str(threads),
            *(["--limit", str(limit)] if limit else []), "--out", str(out)]


def train(arms: list[str]) -> None:
    store = features()
    for arm in arms:
        if not (WORK / arm / "model.safetensors").is_file():
            resume = ["--resume"] if (WORK / arm).is_dir() else []
            run(train_args(arm, store) + resume)
        for name in SETS:
            if not (OUT / f"{arm}-{name}.json").is_file():
                run(evaluate_args(arm, name, fixed_val(name)))


def scored(arm: str) -> bool:
    return all((OUT / f"{arm}-{name}.json").is_file() for name in SETS)


def tau_files() -> list[Path]:
    return sorted(OUT.glob("tau*.json"))


def tau_prompts() -> tuple[dict[str, list[dict]], list[dict]]:
    """Per-prompt τ of every replayed arm (the first replay and the later ones, which must share its prompts and tree)
    and the replays' own records."""
    replays = [json.loads(path.read_text()) for path in tau_files()]
    prompts: dict[str, list[dict]] = {}
    for replay in replays:
        if (replay["tree"], replay["limits"], replay["max_new_tokens"]) != (
                replays[0]["tree"], replays[0]["limits"], replays[0]["max_new_tokens"]):
            raise SystemExit(f"error: {replay['command']} replayed other prompts or another tree than "
                             f"{replays[0]['command']}: rerun it with the same settings")
        prompts |= {name: replay["heads"][name]["0"]["per_prompt"] for name in replay["heads"]}  # names: the arms
    return prompts, replays


def tau_rows(prompts: dict[str, list[dict]]) -> tuple[list[list], dict]:
    """τ per replayed arm and each against eagle3, paired per prompt; eagle3-wide against tgf (the same size)."""
    rows, figures = [], {}
    for arm in (arm for arm in ARMS if arm in prompts):
        pooled = pooled_tau(prompts[arm])
        paired = paired_difference(prompts[arm], prompts["eagle3"]) if arm != "eagle3" else None
        figures[arm] = {**pooled, "minus_eagle3": paired}
        rows.append([arm, f"{pooled['tau']:.3f} ± {pooled['se']:.3f}",
                     "-" if paired is None else f"{paired['diff']:+.3f} ± {paired['se']:.3f}",
                     "-" if paired is None else f"{pooled['tau'] / (pooled['tau'] - paired['diff']):.3f}x"])
    if {"tgf", "eagle3-wide"} <= prompts.keys():
        figures["tgf"]["minus_eagle3_wide"] = paired_difference(prompts["tgf"], prompts["eagle3-wide"])
    return rows, figures


def arm_facts(arm: str, committed: dict) -> dict:
    """Parameters, training seconds, tokens and machine of an arm: from its head in work/parts/ where it is on this
    machine, else as the committed parts.json recorded them."""
    head = WORK / arm
    if not (head / "model.safetensors").is_file():
        return {key: committed["arms"][arm][key] for key in ("parameters", "train_seconds", "tokens", "cpu")}
    run = json.loads((head / "validation.json").read_text())
    return {"parameters": DraftModel.from_pretrained(head).num_parameters(),
            "train_seconds": round(run["epochs"][-1].get("train_seconds", 0)),
            "tokens": sum(e["tokens"] for e in run["epochs"]), "cpu": machine_info()["cpu"]}


def table() -> None:
    """The table of the arms scored so far (an arm not trained yet is named below it)."""
    committed = json.loads((HERE / "parts.json").read_text()) if (HERE / "parts.json").is_file() else {"arms": {}}
    arms = [arm for arm in ARMS if scored(arm)]
    reports = {(arm, name): json.loads((OUT / f"{arm}-{name}.json").read_text()) for arm in arms for name in SETS}
    facts = {arm: arm_facts(arm, committed) for arm in arms}
    rows = []
    for arm in arms:
        _, flags, tgf, dual = ARMS[arm]
        row = [arm, "yes" if tgf else "no", "yes" if dual else "no", " ".join(flags) or "-"]
        for name in SETS:
            passes = reports[(arm, name)]["passes"]
            row += [f"{passes[0]['top1']:.3f}", " ".join(f"{reach(p):.3f}" for p in passes[1:5])]
        row += [f"{facts[arm]['parameters'] / 1e6:.2f}", f"{facts[arm]['train_seconds']:.0f}", facts[arm]["cpu"]]
        rows.append(row)
    headers = ["arm", "Token-Guided Fusion", "dual heads", "flags", "top-1 pass 1 (ShareGPT)",
               "reach passes 2-5 (ShareGPT)", "top-1 pass 1 (answers)", "reach passes 2-5 (answers)", "parameters (M)",
               "train s (shared cores)", "trained on"]
    tokens = {arm: facts[arm]["tokens"] for arm in arms}
    positions = {name: reports[(arms[0], name)]["passes"][0]["positions"] for name in SETS} if arms else {}
    prompts, replays = tau_prompts()
    tau, figures = tau_rows(prompts)
    text = ("# griffin3's architecture taken apart: Token-Guided Fusion and dual heads\n\n"
            f"Heads trained from scratch on one ShareGPT shard (shard {SHARD} of the recipe's store, fp32 features; "
            f"{', '.join(f'{a} {t:,}' for a, t in tokens.items())} tokens) with `factorial.py`'s settings "
            f"(`{' '.join(TRAIN)}`; no alignment mask), scored with `training.evaluate --steps 7 --topk 3` on the "
            "recipe's fixed validation sets in fp32 (27 ShareGPT and 21 answer conversations, "
            f"{', '.join(f'{n:,} {s} positions' for s, n in positions.items())} at pass 1). Reach at pass i = "
            "kept x top-1: the positions where the head's first guess at depth i is right with every earlier "
            "depth's right token among its top-3 (`mask.md`). eagle3-wide is eagle3 with the draft layer's MLP "
            "widened to tgf's parameter count, so that tgf against it tells Token-Guided Fusion from its size.\n\n"
            + markdown_table(headers, rows)
            + "".join(f"\nNot trained yet: {arm} (`python benchmarks/results/recipe3-tau/parts.py --arms {arm}`).\n"
                      for arm in ARMS if arm not in arms))
    if tau:
        text += ("\n\nOffline τ on the ablation's tree (depth 5, top-k 8, 24 nodes), MT-Bench T=0, "
                 f"{replays[0]['n_prompts']['0']} prompts, fp32 ("
                 + ", ".join(f"[parts/{path.stem}.md](parts/{path.stem}.md)" for path in tau_files())
                 + "); each arm against eagle3 paired per prompt (`griffin.report.paired_difference`):\n\n"
                 + markdown_table(["arm", "τ", "τ − eagle3's", "ratio"], tau))
        wide = figures.get("tgf", {}).get("minus_eagle3_wide")
        if wide:
            text += (f"\n\ntgf − eagle3-wide (the same parameter count, with and without Token-Guided Fusion), "
                     f"paired: {wide['diff']:+.3f} ± {wide['se']:.3f} τ over {wide['n_prompts']} prompts.\n")
    text += ("\n\nCommands:\n\n"
             + "".join(f"- `python {' '.join(train_args(arm, WORK / 'features'))}`\n" for arm in arms)
             + "".join(f"- `python {' '.join(evaluate_args(arm, name, Path(reports[(arm, name)]['features'])))}`\n"
                       for arm in arms for name in SETS)
             + "".join(f"- `{replay['command']}`\n" for replay in replays))
    result = {"arms": {arm: {"arch": ARMS[arm][0], "flags": ARMS[arm][1], "tgf": ARMS[arm][2],
                             "dual_heads": ARMS[arm][3], **facts[arm]} for arm in arms},
              "shard": SHARD, "train": TRAIN, "tokens": tokens,
              "reports": {f"{arm}-{name}": r for (arm, name), r in reports.items()}, "tau": figures,
              "command": "python benchmarks/results/recipe3-tau/parts.py", "machine": machine_info()}
    write_benchmark(HERE, "parts", result, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="only the table, from the evaluation files")
    parser.add_argument("--tau", action="store_true", help="replay the τ of the --arms not replayed yet (after "
                        "training them; a later replay must take the first one's --limit)")
    parser.add_argument("--threads", type=int, default=1, help="--tau: torch threads of the replay")
    parser.add_argument("--limit", type=int, default=None, help="--tau: the first N questions (default: all 80)")
    parser.add_argument("--arms", default=",".join(ARMS), help="the arms to train and score here (comma-separated; "
                        "run two processes with different arms to use two cores)")
    args = parser.parse_args()
    unknown = [arm for arm in args.arms.split(",") if arm not in ARMS]
    if unknown:
        raise SystemExit(f"error: unknown arm(s) {', '.join(unknown)}: --arms takes {', '.join(ARMS)}")
    if args.tau:
        replayed = tau_prompts()[0]
        arms = [arm for arm in args.arms.split(",") if arm not in replayed]
        if arms:
            run(tau_args(arms, args.threads, args.limit))
    elif not args.table:
        train(args.arms.split(","))
    if any(scored(arm) for arm in ARMS):
        table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
