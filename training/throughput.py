"""Throughput of the training pipeline on this machine: regeneration, feature building and head training.

    python -m training.throughput                      # the embedded target and data, a few minutes on 2 CPU cores
    python -m training.throughput --only regeneration  # measure one section, keep the other rows of the file

Regenerates answers to the first turns of ``--regen-prompts`` records with each setting of ``REGEN_SETTINGS``
(``training.regenerate``: transformers ``generate`` in fp32 and bf16, larger batches, a static KV cache; our batched
plain loop; our speculative engine with the shipped head) at 1 and 2 threads; builds a small feature store with each
compute dtype (``training.build_features``); and trains a GRIFFIN head for a few updates with K=1 and K=3 passes, with
and without bf16 autocast (``training.train``). Each runs in its own process as a user would run it, one after another.
Writes ``benchmarks/results/pipeline-throughput.json`` and a markdown table beside it: new tokens/s of regeneration,
target forward tokens/s, disk bytes per token, training tokens/s, and the hours one epoch over a store of
``--plan-tokens`` tokens would take. Sections not measured (``--only``) keep the rows the file already holds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from griffin.cli import run_cli
from griffin.constants import EMBEDDED_TARGET

from .data import DEFAULT_DATA

RESULTS = Path("benchmarks/results")
THROUGHPUT_LINE = re.compile(r"target forward throughput (\d+) tokens/s")
REGEN_LINE = re.compile(r"answered (\d+) prompts.*generation throughput ([\d.]+) tokens/s")
SECTIONS = ("regeneration", "features", "training")
REGEN_SETTINGS = [  # (engine, dtype, batch size, KV cache); the first is regenerate's default
    ("generate", "fp32", 32, "dynamic"),
    ("generate", "bf16", 16, "dynamic"),
    ("generate", "bf16", 48, "dynamic"),
    ("generate", "bf16", 48, "static"),
    ("plain", "bf16", 16, "preallocated"),
    ("plain", "bf16", 32, "preallocated"),
    ("speculative", "bf16", 1, "preallocated"),
]


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
    p.add_argument("--regen-prompts", type=int, default=96, help="records whose first turns each regeneration "
                   "setting answers (about half are usable first turns)")
    p.add_argument("--regen-new-tokens", type=int, default=128, help="--max-new-tokens of regeneration")
    p.add_argument("--threads", default="1,2", help="thread counts of the regeneration rows")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    args.only = [x for x in args.only.split(",") if x]
    if not args.only or any(x not in SECTIONS for x in args.only):
        p.error(f"--only must name some of {', '.join(SECTIONS)}")
    try:
        args.threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        p.error("--threads must be comma-separated integers")
    if min(args.samples, args.updates, args.batch_size, args.max_len) < 1:
        p.error("--samples, --updates, --batch-size and --max-len must be at least 1")
    return args


def run(module: str, *argv: str, threads: int | None = None) -> subprocess.CompletedProcess:
    env = os.environ | ({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {})
    res = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"python -m {module} {' '.join(argv)} failed:\n{res.stderr[-2000:]}")
    return res


def measure_regeneration(args, work: Path, engine: str, dtype: str, batch: int, cache: str, threads: int) -> dict:
    out = work / f"regen-{engine}-{dtype}-{batch}-{cache}-{threads}"
    kv = ["--cache", cache] if engine == "generate" else []  # our engines preallocate their KV buffers
    res = run("training.regenerate", "--target", args.target, "--data", args.data, "--out", str(out),
              "--max-samples", str(args.regen_prompts), "--max-new-tokens", str(args.regen_new_tokens),
              "--batch-size", str(batch), "--dtype", dtype, "--engine", engine, *kv, threads=threads)
    match = REGEN_LINE.search(res.stderr)
    if match is None:
        raise RuntimeError(f"regenerate printed no throughput line:\n{res.stderr[-2000:]}")
    return {"engine": engine, "dtype": dtype, "batch_size": batch, "cache": cache, "threads": threads,
            "prompts": int(match.group(1)), "tokens_per_s": float(match.group(2))}


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
    from griffin.report import markdown_table

    text = f"# Training pipeline throughput\n\nTarget {result['target']}.\n\n"
    if "regeneration" in result:
        r = result["regeneration"]
        rows = [[x["engine"], x["dtype"], x["batch_size"], x["cache"], x["threads"], x["tokens_per_s"],
                 f"{x['tokens_per_s'] / baseline(r['rows'], x['threads']):.2f}x"] for x in r["rows"]]
        text += (f"## Regeneration (`training.regenerate`)\n\nThe usable first turns of the first {r['prompts']} "
                 f"records ({r['rows'][0].get('prompts', '?')} prompts), up to "
                 f"{r['new_tokens']} new tokens each, greedy; new tokens/s over the time spent generating.\n\n"
                 + markdown_table(["engine", "dtype", "batch", "KV cache", "threads", "new tokens/s",
                                   "vs fp32 generate batch 32, same threads"], rows)
                 + f"\nCommand: `{r['command']}`; {machine_text(r['machine'])}\n\n")
    if "features" in result:
        feats = markdown_table(["compute dtype", "stored as", "target forward tokens/s", "disk bytes/token"],
                               [[f["compute_dtype"], f["storage_dtype"], f["tokens_per_s"], f["bytes_per_token"]]
                                for f in result["features"]])
        text += (f"## Feature building\n\n{result['samples']} conversations of up to {result['max_len']} tokens.\n\n"
                 f"{feats}\n")
    if "training" in result:
        plan = result["plan_tokens"]
        train = markdown_table(["passes K", "autocast", "training tokens/s", f"hours per epoch of {plan:,} tokens"],
                               [[t["steps"], t["mixed_precision"], t["tokens_per_s"], t["hours_per_epoch"]]
                                for t in result["training"]])
        text += (f"## Training\n\nGRIFFIN head, batch {result['batch_size']}, draft vocabulary "
                 f"{result['draft_vocab']}, {result['updates']} updates per row.\n\n{train}\n")
    if "command" in result:
        text += f"Features and training: command `{result['command']}`; {machine_text(result['machine'])}\n"
    return text


def baseline(rows: list[dict], threads: int) -> float:
    """New tokens/s of the first setting (the recipe's before issue 11) at this thread count."""
    return next(x["tokens_per_s"] for x in rows if x["threads"] == threads)


def machine_text(machine: dict) -> str:
    """The shared machine line (CPU with its vector extensions: bf16 is emulated without AVX512-BF16 or AMX) and the
    load average when the section finished."""
    from griffin.report import machine_text as shared

    load = f", load average {machine['load_average_1m']}" if "load_average_1m" in machine else ""
    return f"machine {shared(machine)}{load}."


def main(argv: list[str] | None = None) -> int:
    from griffin.report import command_line, machine_info, write_benchmark

    args = parse_args(argv)
    path = Path(args.out_dir) / "pipeline-throughput.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    result["target"] = args.target
    with tempfile.TemporaryDirectory(prefix="griffin-throughput-") as tmp:
        work = Path(tmp)
        if "regeneration" in args.only:
            rows = [measure_regeneration(args, work, *setting, threads)
                    for threads in args.threads for setting in REGEN_SETTINGS]
            result["regeneration"] = {"prompts": args.regen_prompts, "new_tokens": args.regen_new_tokens,
                                      "rows": rows, "machine": machine_info(),
                                      "command": command_line("training.throughput", argv)}
        if "features" in args.only or "training" in args.only:
            features = [measure_features(args, work, dtype) for dtype in ("fp32", "bf16")]
            store = features[1]["store"]
            for f in features:
                f.pop("store")
            if "features" in args.only:
                result.update(samples=args.samples, max_len=args.max_len, features=features)
            if "training" in args.only:
                result.update(updates=args.updates, batch_size=args.batch_size, draft_vocab=args.draft_vocab,
                              plan_tokens=args.plan_tokens,
                              training=[measure_training(args, store, work, steps, precision)
                                        for steps in (1, 3) for precision in ("no", "bf16")])
            result.update(machine=machine_info(), command=command_line("training.throughput", argv))
    write_benchmark(args.out_dir, "pipeline-throughput", result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, (RuntimeError,)))
