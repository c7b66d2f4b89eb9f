"""The EAGLE-3-generation heads' first step on the embedded target: top-1 of every head trained on the same data.

    python -m benchmarks.eagle3_first_step --work work/eagle3 --heads griffin eagle3 griffin3 eagle3-init griffin3-init

Reads what ``training/recipes/smollm2-135m-eagle3.sh`` left in ``--work`` (no model is run): each head's training
report (``validation.json``: top-1 per pass on its held-out conversations) and its scores on the recipe's two fixed
validation sets (``fixed-val-{regen,sharegpt}.json`` from ``training.evaluate --steps 1``), and writes
``benchmarks/results/eagle3-first-step.{json,md}`` beside the shipped heads' first point of the learning curve
(``benchmarks/results/recipe/recipe.json``, chunk 0).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from griffin.cli import run_cli
from griffin.constants import FUSED_ARCHS
from griffin.io import read_json
from griffin.report import command_line, markdown_table, write_benchmark

RECIPE = "benchmarks/results/recipe/recipe.json"


def head_row(folder: Path) -> dict:
    report = read_json(folder / "validation.json", "training report")
    run, last = report["run"], report["epochs"][-1]
    fused = run["arch"] in FUSED_ARCHS  # runs from before --lm-head-init started the fused lm_head at random
    row = {"head": folder.name, "arch": run["arch"], "ttt_steps": run.get("ttt_steps") or 0, "topk": run["topk"],
           "lm_head_init": run.get("lm_head_init") or ("random" if fused else None), "lr": run["lr"],
           "tokens": last["tokens"],
           "train_tokens_per_s": round(last["train_tokens_per_s"], 1),
           "held_out_top1": [p["top1"] for p in last["passes"]]}
    for kind in ("regen", "sharegpt"):
        row[f"fixed_{kind}_top1"] = read_json(folder / f"fixed-val-{kind}.json", "fixed-set score")["passes"][0]["top1"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.eagle3_first_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="work/eagle3", help="the recipe script's work folder")
    p.add_argument("--heads", nargs="+", required=True, help="head folders in --work")
    p.add_argument("--out", default="benchmarks/results/eagle3-first-step")
    args = p.parse_args(argv)
    rows = [head_row(Path(args.work) / name) for name in args.heads]
    shipped = [c for c in read_json(Path(RECIPE), "recipe record")["curve"] if c["chunk"] == 0]
    reference = [{"head": c["head"], "tokens": c["tokens_seen"], "fixed_regen_top1": c["fixed"]["regen"][0]["top1"],
                  "fixed_sharegpt_top1": c["fixed"]["sharegpt"][0]["top1"]} for c in shipped]
    table = markdown_table(
        ["head", "arch", "training", "lm_head start", "tokens", "top-1 regen", "top-1 ShareGPT",
         "held-out top-1 by pass", "train tok/s"],
        [[r["head"], r["arch"], f"TTT L={r['ttt_steps']}" if r["ttt_steps"] else "K=1",
          r["lm_head_init"] or "target's (shared)", f"{r['tokens']:,}", f"{r['fixed_regen_top1']:.3f}",
          f"{r['fixed_sharegpt_top1']:.3f}",
          " ".join("-" if t is None else f"{t:.2f}" for t in r["held_out_top1"]) + (f" (top-{r['topk']} mask)"
                                                                                   if r["topk"] and r["ttt_steps"]
                                                                                   else ""),
          f"{r['train_tokens_per_s']:.0f}"] for r in rows])
    ref_table = markdown_table(["shipped recipe head, after chunk 0", "tokens", "top-1 regen", "top-1 ShareGPT"],
                               [[r["head"], f"{r['tokens']:,}", f"{r['fixed_regen_top1']:.3f}",
                                 f"{r['fixed_sharegpt_top1']:.3f}"] for r in reference])
    text = (f"# EAGLE-3-generation heads, first step\n\n`{command_line('benchmarks.eagle3_first_step', argv)}`\n\n"
            "Heads trained one epoch on the same 217 ShareGPT conversations (the first shard of the recipe's chunk 0, "
            "--max-len 1024, learning rate 1e-3 as the recipe's stage 1, draft vocabulary 8192), scored at pass 1 on "
            "the recipe's fixed validation sets (regen: the target's own answers; ShareGPT). Training speed at one "
            "thread on a shared machine (three trainings at a time).\n\n"
            f"{table}\n\nFor scale, the shipped recipe's stage-1 heads after its whole chunk 0:\n\n{ref_table}\n")
    out = Path(args.out)
    write_benchmark(out.parent, out.name, {"command": command_line("benchmarks.eagle3_first_step", argv),
                                           "heads": rows, "shipped_chunk0": reference}, text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
