"""Throughput of the training pipeline on this machine: feature building and head training, fp32 against bf16.

    python -m training.throughput                      # the embedded target and data, a few minutes on 2 CPU cores

Builds a small feature store with each compute dtype (``training.build_features``) and trains a GRIFFIN head for a
few updates with K=1 and K=3 passes, with and without bf16 autocast (``training.train``), each in its own process as
a user would run them, one after another. Writes ``benchmarks/results/pipeline-throughput.json`` and a markdown table
beside it: target forward tokens/s, disk bytes per token, training tokens/s, and the hours one epoch over a store of
``--plan-tokens`` tokens would take.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from griffin.constants import EMBEDDED_TARGET

from .cli import run_cli
from .data import DEFAULT_DATA

RESULTS = Path("benchmarks/results")
THROUGHPUT_LINE = re.compile(r"target forward throughput (\d+) tokens/s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--samples", type=int, default=64, help="conversations to build features for")
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--updates", type=int, default=12, help="training updates per configuration")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--plan-tokens", type=int, default=1_000_000, help="store size for the hours-per-epoch column")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    if min(args.samples, args.updates, args.batch_size, args.max_len) < 1:
        p.error("--samples, --updates, --batch-size and --max-len must be at least 1")
    return args


def run(module: str, *argv: str) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"python -m {module} {' '.join(argv)} failed:\n{res.stderr[-2000:]}")
    return res


def measure_features(args, work: Path, dtype: str) -> dict:
    out = work / f"features-{dtype}"
    res = run("training.build_features", "--target", args.target, "--data", args.data, "--out", str(out),
              "--max-samples", str(args.samples), "--max-len", str(args.max_len), "--dtype", dtype)
    match = THROUGHPUT_LINE.search(res.stderr)
    if match is None:
        raise RuntimeError(f"build_features printed no throughput line:\n{res.stderr[-2000:]}")
    manifest = json.loads((out / "manifest.json").read_text())
    size = sum((out / s["file"]).stat().st_size for s in manifest["shards"])
    return {"compute_dtype": dtype, "storage_dtype": manifest["dtype"], "tokens": manifest["num_tokens"],
            "conversations": manifest["num_samples"], "tokens_per_s": int(match.group(1)),
            "bytes_per_token": size / manifest["num_tokens"], "store": str(out)}


def measure_training(args, store: str, work: Path, steps: int, precision: str) -> dict:
    out = work / f"train-k{steps}-{precision}"
    run("training.train", "--features", store, "--out", str(out), "--arch", "griffin", "--steps", str(steps),
        "--topk", "3", "--max-updates", str(args.updates), "--batch-size", str(args.batch_size), "--draft-vocab",
        str(args.draft_vocab), "--mixed-precision", precision, "--lr", "1e-3", "--save-every", str(10**9))
    record = json.loads((out / "validation.json").read_text())["epochs"][-1]
    rate = record["train_tokens_per_s"]
    return {"steps": steps, "mixed_precision": precision, "updates": record["updates"], "tokens": record["tokens"],
            "tokens_per_s": rate, "hours_per_epoch": args.plan_tokens / rate / 3600}


def table(result: dict) -> str:
    from inference.report import markdown_table

    feats = markdown_table(["compute dtype", "stored as", "target forward tokens/s", "disk bytes/token"],
                           [[f["compute_dtype"], f["storage_dtype"], f["tokens_per_s"], f["bytes_per_token"]]
                            for f in result["features"]])
    plan = result["plan_tokens"]
    train = markdown_table(["passes K", "autocast", "training tokens/s", f"hours per epoch of {plan:,} tokens"],
                           [[t["steps"], t["mixed_precision"], t["tokens_per_s"], t["hours_per_epoch"]]
                            for t in result["training"]])
    machine = result["machine"]
    return (f"# Training pipeline throughput\n\nTarget {result['target']}; {result['samples']} conversations of up to "
            f"{result['max_len']} tokens; GRIFFIN head, batch {result['batch_size']}, draft vocabulary "
            f"{result['draft_vocab']}, {result['updates']} updates per row.\n\n## Feature building\n\n{feats}\n"
            f"## Training\n\n{train}\nCommand: `{result['command']}`\n\nMachine: {machine['cpu']}, "
            f"{machine['cores']} cores, torch {machine['torch']}, {machine['date']}.\n")


def main(argv: list[str] | None = None) -> int:
    from inference.report import command_line, machine_info, write_benchmark

    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="griffin-throughput-") as tmp:
        work = Path(tmp)
        features = [measure_features(args, work, dtype) for dtype in ("fp32", "bf16")]
        store = features[1]["store"]
        training = [measure_training(args, store, work, steps, precision)
                    for steps in (1, 3) for precision in ("no", "bf16")]
    for f in features:
        f.pop("store")
    result = {"target": args.target, "samples": args.samples, "max_len": args.max_len, "updates": args.updates,
              "batch_size": args.batch_size, "draft_vocab": args.draft_vocab, "plan_tokens": args.plan_tokens,
              "features": features, "training": training, "machine": machine_info(),
              "command": command_line("training.throughput")}
    write_benchmark(args.out_dir, "pipeline-throughput", result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, (RuntimeError,)))
