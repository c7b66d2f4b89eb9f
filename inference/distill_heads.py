"""Distillation objectives on our target: GRIFFIN heads fine-tuned from one initial head with each token objective.

    python -m inference.distill_heads --train --features /work/data/features-distill --heads /work/data/distill-heads
    python -m inference.distill_heads --evaluate --heads /work/data/distill-heads    # τ of every head (inference.tau)
    python -m inference.distill_heads --heads /work/data/distill-heads               # only rebuild the report

Every head starts from ``--init`` (the shipped GRIFFIN head) and gets the same data, schedule and budget (one
``training.train`` run each, K=3, top-3 alignment mask, the init head's draft vocabulary); only the token loss
differs, plus AdaSPEC token selection on top of FKL with the FKL head as its reference. τ is measured offline
(``inference.tau``) on one fixed tree for every head; the initial head is measured too, as the no-fine-tuning row.
Training resumes where it stopped; a head whose ``validation.json`` exists is not retrained. τ results go to
``--results`` (one JSON per head and temperature), the report to ``benchmarks/results/distill-heads.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from training.cli import run_cli

INIT = "init (no fine-tuning)"
OBJECTIVES = {  # head name -> training.train flags; {heads} is the heads folder
    "soft-ce": ["--token-loss", "soft-ce"],
    "fkl": ["--token-loss", "fkl"],
    "fkl-adaspec": ["--token-loss", "fkl", "--select", "adaspec", "--reference", "{heads}/fkl",
                    "--select-frac", "0.4"],
    "tvd": ["--token-loss", "tvd"],
    "tvdpp": ["--token-loss", "tvdpp"],
    "rkl": ["--token-loss", "rkl"],
    "jsd": ["--token-loss", "jsd", "--jsd-beta", "0.5"],
}
BASELINE = "soft-ce"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference.distill_heads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", action="store_true", help="train the missing heads first")
    p.add_argument("--evaluate", action="store_true", help="measure τ of the heads without results first")
    p.add_argument("--features", default="/work/data/features-distill", help="feature store of the fine-tuning")
    p.add_argument("--heads", default="/work/data/distill-heads", help="folder of the fine-tuned heads")
    p.add_argument("--init", default="checkpoints/smollm2-135m-instruct-griffin", help="the initial head of all")
    p.add_argument("--objectives", default=",".join(OBJECTIVES), help="heads to train / evaluate, comma-separated")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-updates", type=int, default=None, help="per head (default: the epochs)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (the recipe's K>1 stages)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--results", default="benchmarks/results/distill-heads", help="folder of the τ runs")
    p.add_argument("--report", default="benchmarks/results/distill-heads.md", help="the table; json and png beside")
    p.add_argument("--bench", default="mt_bench")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--limits", default="0:all,1:20", help="questions per temperature (all = every question)")
    p.add_argument("--total-tokens", type=int, default=24)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    args.names = [n for n in args.objectives.split(",") if n]
    unknown = sorted(set(args.names) - set(OBJECTIVES))
    if unknown:
        p.error(f"unknown objectives {unknown}: choose from {', '.join(OBJECTIVES)}")
    args.temps = [float(t) for t in args.temperatures.split(",")]
    limits = dict(item.split(":") for item in args.limits.split(","))
    args.limit = {t: (None if limits.get(f"{t:g}", "all") == "all" else int(limits[f"{t:g}"])) for t in args.temps}
    return args


def train_command(args, name: str) -> list[str]:
    flags = [f.format(heads=args.heads) for f in OBJECTIVES[name]]
    cmd = [sys.executable, "-m", "training.train", "--features", args.features, "--out", f"{args.heads}/{name}",
           "--init-from", args.init, "--steps", "3", "--topk", "3", "--lr", str(args.lr), "--batch-size",
           str(args.batch_size), "--epochs", str(args.epochs), "--mixed-precision", "bf16", "--save-every", "10"]
    if args.max_updates:
        cmd += ["--max-updates", str(args.max_updates)]
    return cmd + flags


def train_missing(args) -> None:
    order = sorted(args.names, key=lambda n: n != "fkl")  # the AdaSPEC reference first
    for name in order:
        out = Path(args.heads) / name
        if (out / "validation.json").is_file() and (out / "model.safetensors").is_file():
            print(f"{name}: trained already ({out})", flush=True)
            continue
        cmd = train_command(args, name) + (["--resume"] if (out / "train_state").exists() else [])
        print(f"{name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env)
        print(f"{name}: trained in {time.perf_counter() - start:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.train:
        train_missing(args)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, (subprocess.CalledProcessError,)))
