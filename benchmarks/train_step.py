"""Seconds per training update of the EAGLE-3-generation heads, with the soft cross-entropy scored inside the
rollout (``training.losses.LinearSoftCrossEntropy``, the default) against scored afterwards over fp32 [N, V] logits.

    python -m benchmarks.train_step --out benchmarks/results/train-step

Builds a feature store of the embedded target with its three fused layers from the first ``--conversations`` ShareGPT
records (a temporary folder unless ``--store`` names one), then trains each head and arm for ``--updates`` updates
with the recipe's settings (TTT 7, no token mask, batch 4, draft vocabulary 8,192, bf16 autocast, one thread), arms
interleaved, ``--repeats`` times, after one update of each as a warm-up. The time is the trainer's own update time
(``train_seconds`` in its ``validation.json``: no loading, no validation). The two arms of a repeat also report their
validation loss after the updates, which should agree to float noise. Writes JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

ARMS = {"rollout": True, "logits": False}  # arm -> MultiPassObjective.soft_ce


def train_once(store: Path, out: Path, arch: str, soft_ce: bool, updates: int) -> dict:
    """One short training run; -> its update seconds and validation after the updates."""
    from training import train
    from training.objective import MultiPassObjective

    init = MultiPassObjective.__init__

    def arm(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.soft_ce = self.soft_ce and soft_ce

    MultiPassObjective.__init__ = arm
    try:
        train.main(["--features", str(store), "--out", str(out), "--arch", arch, "--ttt-steps", "7", "--topk", "0",
                    "--lr", "6e-4", "--epochs", "1", "--batch-size", "4", "--draft-vocab", "8192",
                    "--mixed-precision", "bf16", "--val-max", "2", "--max-updates", str(updates)])
    finally:
        MultiPassObjective.__init__ = init
    last = json.loads((out / "validation.json").read_text())["epochs"][-1]
    return {"seconds_per_update": last["train_seconds"] / last["updates"],
            "val_loss": [p["loss"] for p in last["passes"]], "val_top1": [p["top1"] for p in last["passes"]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        for arch in args.heads.split(","):  # warm-up: the process's first updates of each arm, not recorded
            for name, soft_ce in ARMS.items():
                train_once(store, work / f"{arch}-{name}-warm-up", arch, soft_ce, 1)
        runs = []
        for repeat in range(args.repeats):
            for arch in args.heads.split(","):
                for name, soft_ce in ARMS.items():
                    result = train_once(store, work / f"{arch}-{name}-{repeat}", arch, soft_ce, args.updates)
                    runs.append({"head": arch, "arm": name, "repeat": repeat, **result})
                    print(f"{arch} {name} repeat {repeat}: {result['seconds_per_update']:.2f} s/update", flush=True)
    rows, summary = [], {}
    for arch in args.heads.split(","):
        arm = {name: [r for r in runs if (r["head"], r["arm"]) == (arch, name)] for name in ARMS}  # repeat order
        median = {name: statistics.median(r["seconds_per_update"] for r in arm[name]) for name in ARMS}
        loss_diff = max(abs(x - y) for a, b in zip(arm["rollout"], arm["logits"], strict=True)
                        for x, y in zip(a["val_loss"], b["val_loss"], strict=True))
        summary[arch] = {"median_s": median, "speedup": median["logits"] / median["rollout"],
                         "max_val_loss_diff": loss_diff}
        rows.append([arch, f"{median['logits']:.2f}", f"{median['rollout']:.2f}",
                     f"{median['logits'] / median['rollout']:.2f}x", f"{loss_diff:.1e}"])
    machine = machine_info()
    command = command_line("benchmarks.train_step", argv)
    result = {"command": command, "machine": machine, "settings": vars(args), "runs": runs, "summary": summary}
    atomic_write_json(Path(args.out + ".json"), result)
    headers = ["head", "logits s/update", "rollout s/update", "speedup", "largest val loss difference"]
    table = markdown_table(headers, rows)
    atomic_write_text(Path(args.out + ".md"), f"# Training update: soft-CE in the rollout against over the logits\n\n"
                      f"`{command}` on {machine_text(machine)}; median of {args.repeats} interleaved repeats of "
                      f"{args.updates} updates after a warm-up, one thread.\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
