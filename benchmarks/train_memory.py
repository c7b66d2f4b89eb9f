"""Resident memory of a CPU training: with and without giving freed heap pages back to the OS after every update.

    python benchmarks/train_memory.py --source work/features-sharegpt-3layers --shard 64 \
        --init-from checkpoints/smollm2-135m-instruct-recipe3/wip-eagle3

Trains the same eagle3 head on one ShareGPT shard of a three-layer store for ``--updates`` updates with the recipe's
settings (TTT 7, bf16 autocast, batch 4), the arms side by side (``--sequential``: one after the other), one torch
thread each:

- ``trim``: ``training.train`` as it is (``release_freed_memory`` after every update on CPU);
- ``no-trim``: the same with that call replaced by a no-op (the trainer before it had one);
- ``mmap1m``: ``no-trim`` under ``MALLOC_MMAP_THRESHOLD_=1048576`` (every block of 1 MiB or more mapped on its own).

Each arm's resident set is sampled from ``/proc`` every ``--every`` seconds; its peak is the kernel's (``wait4``).
Writes ``--out``.json and .md (default ``benchmarks/results/train-memory-trim``); the heads go to ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ARMS = {  # name -> (release freed pages after each update, extra environment)
    "trim": (True, {}),
    "no-trim": (False, {}),
    "mmap1m": (False, {"MALLOC_MMAP_THRESHOLD_": "1048576"}),
}
TRAIN = ["--arch", "eagle3", "--ttt-steps", "7", "--topk", "0", "--lr", "0.000368", "--epochs", "1", "--batch-size",
         "4", "--draft-vocab", "8192", "--mixed-precision", "bf16", "--save-every", "1000"]
NO_TRIM = "import sys, training.train as t; t.release_freed_memory = lambda: False; sys.exit(t.main(sys.argv[1:]))"


def view(source: Path, shard: int, folder: Path) -> Path:
    """A store of shard ``shard`` of ``source``, hard-linked so that it outlives the recipe's clean-up."""
    from training.store import BUILD, MANIFEST, link_view, shard_name

    data = f"{source.name} shard {shard}"
    if (folder / MANIFEST).is_file() and json.loads((folder / BUILD).read_text()).get("data") == data:
        return folder
    if not (source / shard_name(shard)).is_file():
        raise SystemExit(f"error: {source} has no shard {shard}: build it with python -m training.build_features "
                         f"--data sharegpt --out {source} --shards {shard}:{shard + 1} --shard-size 256 --max-len 1024 "
                         "--feature-layers auto (the recipe's shards), or pick a shard it holds")
    return link_view(source, [shard], folder, data, hard=True)


def rss_gb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def run_arms(arms: list[str], store: Path, args) -> dict:
    """The arms side by side -> per arm: peak and sampled RSS (GB), wall seconds, exit status."""
    procs, started, samples, result, logs = {}, {}, {arm: [] for arm in arms}, {}, []
    for arm in arms:
        trim, extra = ARMS[arm]
        out = args.work / arm
        if out.exists():
            shutil.rmtree(out)
        cmd = ["-m", "training.train"] if trim else ["-c", NO_TRIM]
        cmd += ["--features", str(store), "--out", str(out), "--init-from", args.init_from, "--max-updates",
                str(args.updates), *TRAIN]
        env = os.environ | {"OMP_NUM_THREADS": "1"} | extra
        logs.append(open(args.work / f"{arm}.log", "w"))
        procs[arm] = subprocess.Popen([sys.executable, *cmd], env=env, stdout=subprocess.DEVNULL, stderr=logs[-1])
        started[arm] = time.perf_counter()
    while procs:
        time.sleep(args.every)
        for arm, proc in list(procs.items()):
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid == 0:
                rss = rss_gb(proc.pid)
                if rss is not None:
                    samples[arm].append([round(time.perf_counter() - started[arm]), round(rss, 2)])
                continue
            result[arm] = {"env": " ".join(f"{k}={v}" for k, v in ARMS[arm][1].items()) or "-",
                           "trim": ARMS[arm][0], "exit": os.waitstatus_to_exitcode(status),
                           "wall_s": round(time.perf_counter() - started[arm], 1),
                           "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2), "rss_samples": samples[arm]}
            del procs[arm]
    for log in logs:
        log.close()
    return result


def markdown(result: dict) -> str:
    from griffin.report import machine_text, markdown_table

    rows = []
    for arm, r in result["runs"].items():
        samples = [rss for _, rss in r["rss_samples"]]
        at = [samples[min(len(samples) - 1, len(samples) * q // 4)] if samples else None for q in (1, 2, 4)]
        rows.append([arm, f"`{r['env']}`", "yes" if r["trim"] else "no", *at, r["peak_rss_gb"], round(r["wall_s"]),
                     r["exit"]])
    return (f"# Training memory: freed heap pages given back after every update\n\n"
            f"Resident memory of one CPU training ({result['updates']} updates of eagle3 on {result['store']}, TTT 7, "
            "bf16 autocast, batch 4, from the recipe's head), the arms "
            + ("side by side" if result["side_by_side"] else "one after the other") + ", one torch thread each. RSS "
            f"sampled from /proc every {result['every']} s; peak from the kernel (wait4).\n\n"
            + markdown_table(["arm", "environment", "malloc_trim each update", "RSS at 1/4 (GB)", "at 1/2",
                              "at the end", "peak RSS (GB)", "wall s (to --every)", "exit"], rows)
            + f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(result['machine'])}.\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, default=Path("work/features-sharegpt-3layers"),
                   help="a three-layer ShareGPT store holding --shard (the recipe's)")
    p.add_argument("--shard", type=int, default=64)
    p.add_argument("--init-from", default="checkpoints/smollm2-135m-instruct-recipe3/wip-eagle3")
    p.add_argument("--arms", default="no-trim,trim", help=f"comma-separated, run side by side: {', '.join(ARMS)}")
    p.add_argument("--sequential", action="store_true", help="one arm at a time (one core for the arms)")
    p.add_argument("--updates", type=int, default=40)
    p.add_argument("--every", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--work", type=Path, default=Path("work/train-memory"))
    p.add_argument("--out", default="benchmarks/results/train-memory-trim", help="results stem (.json and .md)")
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        p.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    from griffin.io import atomic_write_json, atomic_write_text
    from griffin.report import machine_info

    args.work.mkdir(parents=True, exist_ok=True)
    store = view(args.source, args.shard, args.work / "features")
    runs = {}
    for group in ([[arm] for arm in arms] if args.sequential else [arms]):
        runs |= run_arms(group, store, args)
    result = {"command": " ".join(["python benchmarks/train_memory.py", *(sys.argv[1:] if argv is None else argv)]),
              "store": f"{args.source} shard {args.shard}", "updates": args.updates, "every": args.every,
              "side_by_side": not args.sequential,
              "init_from": args.init_from, "runs": runs, "machine": machine_info() | {"torch_threads": 1}}
    text = markdown(result)
    atomic_write_json(Path(args.out + ".json"), result)
    atomic_write_text(Path(args.out + ".md"), text)
    print(text)
    return 0 if all(r["exit"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
