"""Export a trained head for shipping: fp16 weights, its validation report and a model card.

    python -m training.export heads/griffin checkpoints/smollm2-135m-instruct-griffin --name GRIFFIN

The card is rebuilt from the files alone: the training run (``validation.json``), and every speed run of this head
found under ``benchmarks/results`` (files named ``<bench>-<head folder name>-T<temp>.json``). Rerun after new speed
runs to refresh it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from griffin.io import atomic_write, atomic_write_json, atomic_write_text, read_json
from inference.report import markdown_table, tree_text

from .cli import run_cli

if TYPE_CHECKING:
    from griffin.draft import DraftModel


STAGES = "stages.json"  # the validation reports of every training stage, oldest first


def card(name: str, dst: Path, head: DraftModel, report: dict, results: list[dict], stages: list[dict],
         notes: str = "") -> str:
    cfg = head.config
    run = report["run"]
    lines = [
        f"# {name} draft head for {cfg.target.get('name') or 'its target'}",
        "",
        f"Architecture `{cfg.arch}` ({head.num_parameters() / 1e6:.2f} M parameters; the target's embedding and "
        f"lm_head are shared at run time), draft vocabulary {cfg.draft_vocab_size or cfg.vocab_size} tokens, "
        f"weights in fp16.",
        "",
        "## Training",
        "",
    ]
    rows = []
    for stage in stages:
        r = stage["run"]
        last = stage["epochs"][-1]
        rows.append([r["steps"], r["topk"], f"{r['lr']:g}", r["total_updates"], r["global_batch"], last["tokens"],
                     f"{last['train_seconds'] / 3600:.2f}", r["mixed_precision"]])
    lines.append(markdown_table(["K (passes)", "top-k mask", "lr", "updates", "batch", "tokens seen", "hours",
                                 "autocast"], rows))
    lines += [f"Data: the feature store `{run['features']}` ({run['train_conversations']} training and "
              f"{run['val_conversations']} held-out conversations, the target's own hidden states). Optimiser AdamW "
              "(0.9, 0.95), cosine schedule with warm-up, gradient clipping 0.5, feature noise "
              f"{run['noise']}.{' ' + notes if notes else ''}", "", "## Validation (held-out conversations, last "
              "epoch)", ""]
    passes = report["epochs"][-1]["passes"]
    topk_key = next((k for k in passes[0] if k.startswith("top") and k != "top1"), "top1")
    lines.append(markdown_table(["pass", "top-1", topk_key.replace("top", "top-"), "kept", "loss"],
                                [[p["pass"], p["top1"], p[topk_key], p["kept"], p["loss"]] for p in passes]))
    lines += ["`kept`: fraction of positions still in the loss at that pass (the alignment mask).", ""]
    if results:
        lines += ["## Measured acceptance length and speed", ""]
        rows = [[r["bench"], r["temperature"], r["n_prompts"], r["max_new_tokens"],
                 tree_text(r["tree"]), r["tau"],
                 r.get("speedup", "-"), r.get("identical_fraction", "-"), r["machine"]["date"]] for r in results]
        lines.append(markdown_table(["bench", "T", "prompts", "max new", "tree", "τ", "speedup vs HF generate",
                                     "identical", "measured"], rows))
        commands = dict.fromkeys(r["command"] for r in results)  # in order, once (`--bench all` writes several)
        lines += ["Commands:", ""] + [f"- `{c}`" for c in commands] + [""]
    lines += ["## Use", "", "```python", "from griffin import SpecGenerator",
              f'gen = SpecGenerator.from_pretrained("{cfg.target.get("name")}", "{dst.as_posix()}")', "```", ""]
    return "\n".join(lines)


def stage_reports(src: Path) -> list[dict]:
    """The validation reports of a head and of the earlier stages it was initialised from, oldest first."""
    from .train import VALIDATION

    reports: list[dict] = []
    folder: Path | None = src
    while folder is not None and (folder / VALIDATION).is_file() and len(reports) < 16:
        report = json.loads((folder / VALIDATION).read_text())
        reports.insert(0, report)
        init = report["run"].get("init_from")
        folder = Path(init) if init else None
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="trained head folder (output of training.train)")
    p.add_argument("dst", help="destination folder, e.g. checkpoints/<target>-<method>")
    p.add_argument("--name", default=None, help="the method's name in the card")
    p.add_argument("--results", nargs="+", default=["benchmarks/results", "benchmarks/results/ablation"],
                   help="folders of speed-run results")
    p.add_argument("--notes", default="", help="a sentence for the card's training section (e.g. the recipe)")
    args = p.parse_args(argv)
    import torch

    from griffin.draft import DraftModel

    from .train import VALIDATION

    src, dst = Path(args.src), Path(args.dst)
    head = DraftModel.from_pretrained(src)
    report = read_json(src / VALIDATION, "validation report")
    stages = json.loads((src / STAGES).read_text()) if (src / STAGES).is_file() else stage_reports(src)
    if src.resolve() != dst.resolve():
        head.save_pretrained(dst, dtype=torch.float16)
        atomic_write(dst / VALIDATION, lambda path: shutil.copyfile(src / VALIDATION, path))
        atomic_write_json(dst / STAGES, stages)
    files = [f for folder in args.results for f in Path(folder).glob(f"*-{dst.name}-T*.json")]
    results = sorted((json.loads(f.read_text()) for f in files),
                     key=lambda r: (r["bench"], r["temperature"], r["tree"]["total_tokens"]))
    text = card(args.name or head.config.arch, dst, head, report, results, stages, args.notes)
    atomic_write_text(dst / "README.md", text)
    print(f"exported {src} -> {dst} ({len(results)} speed runs in the card)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
