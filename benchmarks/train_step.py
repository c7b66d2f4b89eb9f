"""Seconds per training update of the EAGLE-3-generation heads, training's default against an earlier form of one
part (``--study``):

- ``soft-ce``: the soft cross-entropy scored inside the rollout (``training.losses.LinearSoftCrossEntropy``)
  against scored afterwards over fp32 [N, V] logits;
- ``attention``: the training-time test's chain attention as one fused SDPA call plus a sentinel key
  (``training.objective.chain_attention``) against its scores and probabilities written out
  (``benchmarks.ttt_attention.explicit_chain``).

    python -m benchmarks.train_step --out benchmarks/results/train-step
    python -m benchmarks.train_step --study attention --out benchmarks/results/train-step-attention

Builds a feature store of the embedded target with its three fused layers from the first ``--conversations`` ShareGPT
records (a temporary folder unless ``--store`` names one), then trains each head and arm for ``--updates`` updates
with the recipe's settings (TTT 7, no token mask, batch 4, draft vocabulary 8,192, bf16 autocast, one thread), the
default and the earlier form interleaved, ``--repeats`` times, after one update of each as a warm-up. The time is the
trainer's own update time (``train_seconds`` in its ``validation.json``: no loading, no validation). The two arms of a
repeat also report their validation loss after the updates, which should agree to float noise. Writes JSON and a
markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from unittest import mock

# study -> (title, default arm, earlier arm); each arm's name is also its label in the results
STUDIES = {"soft-ce": ("soft-CE in the rollout against over the logits", "rollout", "logits"),
           "attention": ("TTT chain attention, fused SDPA and a sentinel key against explicit scores", "sentinel",
                         "explicit")}


def earlier_form(study: str):
    """A context manager: training with the study's earlier form in place of the default."""
    from training.objective import MultiPassObjective

    if study == "attention":  # Rollout.chain reads the module's function
        from benchmarks.ttt_attention import explicit_chain

        return mock.patch("training.objective.chain_attention", explicit_chain)
    init = MultiPassObjective.__init__

    def without_soft_ce(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.soft_ce = False

    return mock.patch.object(MultiPassObjective, "__init__", without_soft_ce)


def train_once(store: Path, out: Path, arch: str, study: str, default: bool, updates: int) -> dict:
    """One short training run; -> its update seconds and validation after the updates."""
    from training import train

    with contextlib.nullcontext() if default else earlier_form(study):
        train.main(["--features", str(store), "--out", str(out), "--arch", arch, "--ttt-steps", "7", "--topk", "0",
                    "--lr", "6e-4", "--epochs", "1", "--batch-size", "4", "--draft-vocab", "8192",
                    "--mixed-precision", "bf16", "--val-max", "2", "--max-updates", str(updates)])
    last = json.loads((out / "validation.json").read_text())["epochs"][-1]
    return {"seconds_per_update": last["train_seconds"] / last["updates"],
            "val_loss": [p["loss"] for p in last["passes"]], "val_top1": [p["top1"] for p in last["passes"]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=list(STUDIES), default="soft-ce")
    p.add_argument("--heads", default="eagle3,griffin3")
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--store", default=None, help="feature store folder (built there if missing; default: temporary)")
    p.add_argument("--out", default="benchmarks/results/train-step", help="results stem (.json and .md)")
    args = p.parse_args(argv)
    import torch

    from griffin.io import atomic_write_json, atomic_write_text
    from griffin.report import command_line, machine_info, machine_text, markdown_table
    from training import build_features

    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="train-step-")))
        store = Path(args.store) if args.store else work / "store"
        if not (store / "manifest.json").is_file():
            build_features.main(["--out", str(store), "--max-samples", str(args.conversations), "--max-len", "1024",
                                 "--feature-layers", "auto", "--dtype", "bf16"])
        title, new, old = STUDIES[args.study]
        arms = {new: True, old: False}  # arm -> training's default form
        for arch in args.heads.split(","):  # warm-up: the process's first updates of each arm, not recorded
            for name, default in arms.items():
                train_once(store, work / f"{arch}-{name}-warm-up", arch, args.study, default, 1)
        runs = []
        for repeat in range(args.repeats):
            for arch in args.heads.split(","):
                for name, default in arms.items():
                    result = train_once(store, work / f"{arch}-{name}-{repeat}", arch, args.study, default,
                                        args.updates)
                    runs.append({"head": arch, "arm": name, "repeat": repeat, **result})
                    print(f"{arch} {name} repeat {repeat}: {result['seconds_per_update']:.2f} s/update", flush=True)
    rows, summary = [], {}
    for arch in args.heads.split(","):
        arm = {name: [r for r in runs if (r["head"], r["arm"]) == (arch, name)] for name in arms}  # repeat order
        median = {name: statistics.median(r["seconds_per_update"] for r in arm[name]) for name in arms}
        loss_diff = max(abs(x - y) for a, b in zip(arm[new], arm[old], strict=True)
                        for x, y in zip(a["val_loss"], b["val_loss"], strict=True))
        summary[arch] = {"median_s": median, "speedup": median[old] / median[new], "max_val_loss_diff": loss_diff}
        rows.append([arch, f"{median[old]:.2f}", f"{median[new]:.2f}", f"{median[old] / median[new]:.2f}x",
                     f"{loss_diff:.1e}"])
    machine = machine_info()
    command = command_line("benchmarks.train_step", argv)
    result = {"command": command, "machine": machine, "settings": vars(args), "runs": runs, "summary": summary}
    atomic_write_json(Path(args.out + ".json"), result)
    headers = ["head", f"{old} s/update", f"{new} s/update", "speedup", "largest val loss difference"]
    table = markdown_table(headers, rows)
    atomic_write_text(Path(args.out + ".md"), f"# Training update: {title}\n\n"
                      f"`{command}` on {machine_text(machine)}; median of {args.repeats} interleaved repeats of "
                      f"{args.updates} updates after a warm-up, one thread.\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
