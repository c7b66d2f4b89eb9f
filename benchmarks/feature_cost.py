"""Stored or online target features for EAGLE-3-generation heads: seconds and disk per trained token, measured.

    python benchmarks/feature_cost.py --records 48 --max-len 512 --out benchmarks/results/feature-cost

Builds a store of the first ``--records`` ShareGPT records with the inputs of three target layers, trains an eagle3
head on it (training-time test, 7 passes) and trains the same head with ``--online`` on the same records, each for one
epoch at one thread, one after the other in this process. A stored feature costs one target forward per token for
every head trained on the store; online, each head pays the forward in its own steps. Writes JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=48)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--arch", default="eagle3", choices=["eagle3", "griffin3"])
    p.add_argument("--out", default="benchmarks/results/feature-cost", help="results stem (.json and .md)")
    args = p.parse_args(argv)
    import torch

    from griffin.io import atomic_write_json, atomic_write_text
    from griffin.kernels import cpu_name
    from training import build_features, train

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="feature-cost-"))
    store = work / "store"
    t0 = time.perf_counter()
    assert build_features.main(["--out", str(store), "--max-samples", str(args.records), "--max-len",
                                str(args.max_len), "--feature-layers", "auto"]) == 0
    build_s = time.perf_counter() - t0
    manifest = json.loads((store / "manifest.json").read_text())
    disk = sum(f.stat().st_size for f in store.glob("shard-*.safetensors"))
    common = ["--arch", args.arch, "--draft-vocab", "8192", "--batch-size", "4", "--epochs", "1", "--max-len",
              str(args.max_len), "--val-max", "1"]
    runs = {}
    for mode, source in (("stored", ["--features", str(store)]),
                         ("online", ["--online", "--max-samples", str(args.records)])):
        t0 = time.perf_counter()
        assert train.main([*source, *common, "--out", str(work / mode)]) == 0
        record = json.loads((work / mode / "validation.json").read_text())["epochs"][-1]
        runs[mode] = {"wall_s": round(time.perf_counter() - t0, 1), "train_tokens": record["tokens"],
                      "train_seconds": record["train_seconds"],
                      "seconds_per_token": record["train_seconds"] / record["tokens"]}
    tokens = manifest["num_tokens"]
    forward = build_s / tokens  # seconds of target forward (and writing) per stored token
    stored, online = runs["stored"]["seconds_per_token"], runs["online"]["seconds_per_token"]
    heads = [1, 2, 5, 7]
    result = {
        "command": "python benchmarks/feature_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": cpu_name(), "threads": 1, "python": platform.python_version(),
                    "torch": torch.__version__, "other_load": os.getloadavg()[0]},
        "records": args.records, "max_len": args.max_len, "arch": args.arch, "stored_tokens": tokens,
        "feature_layers": manifest["feature_layers"], "disk_bytes_per_token": disk / tokens,
        "build_seconds": round(build_s, 1), "build_seconds_per_token": forward, "runs": runs,
        "per_trained_token": {str(n): {"stored": forward / n + stored, "online": online} for n in heads},
    }
    atomic_write_json(Path(args.out + ".json"), result)
    rows = "\n".join(f"| {n} | {1e3 * (forward / n + stored):.2f} | {1e3 * online:.2f} |" for n in heads)
    text = (f"# Stored or online features ({args.arch}, training-time test)\n\n"
            f"`{result['command']}` on {result['machine']['cpu']}, one thread, other load "
            f"{result['machine']['other_load']:.1f} (a shared machine: compare within this file).\n\n"
            f"{args.records} ShareGPT records, {tokens} tokens at --max-len {args.max_len}; the store holds the last "
            f"hidden state and the inputs of layers {manifest['feature_layers']}: {disk / tokens:.0f} bytes per token "
            f"on disk. Building it took {build_s:.0f} s ({1e3 * forward:.2f} ms per token). One epoch of training: "
            f"{1e3 * stored:.2f} ms per token from the store, {1e3 * online:.2f} ms per token online (the target's "
            "forward inside each step).\n\n"
            "| heads trained on the same data | stored: ms per trained token (build shared) | online: ms per trained "
            f"token |\n|---|---|---|\n{rows}\n")
    atomic_write_text(Path(args.out + ".md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
