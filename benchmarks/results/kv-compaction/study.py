"""Per-row KV compaction on the CPU: ``scatter_`` (what ``griffin.kv_cache.move_entries`` used before d4c132f) against
advanced indexing (what it uses now), on the target's whole-model buffer at batch 2 of the embedded target.

    OMP_NUM_THREADS=1 python benchmarks/results/kv-compaction/study.py

Buffer [30 layers, K/V, 2 rows, 3 KV heads, 166 slots, 64] (a batch-2 generation of 64 tokens after MT-Bench
prompts); each row moves 3 entries. Median of 50 calls each, after a warm-up. Writes study.json and study.md here.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from griffin.report import machine_info, machine_text


def scatter(buf: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> None:
    lead = buf.dim() - 4
    b, m = source.shape
    shape = (*buf.shape[:lead], b, buf.shape[-3], m, buf.shape[-1])
    view = (*([1] * lead), b, 1, m, 1)
    buf.scatter_(-2, target.view(view).expand(shape), buf.gather(-2, source.view(view).expand(shape)))


def indexing(buf: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> None:
    rows = torch.arange(source.shape[0])[:, None]
    buf[..., rows, :, target, :] = buf[..., rows, :, source, :]


def main() -> None:
    torch.set_num_threads(1)
    source, target = torch.tensor([[100, 101, 103], [100, 102, 104]]), torch.tensor([[90, 91, 92], [95, 96, 97]])
    out = {"shape": [30, 2, 2, 3, 166, 64], "ms": {}}
    for dtype in (torch.float32, torch.bfloat16):
        buf = torch.randn(out["shape"]).to(dtype)
        a, b = buf.clone(), buf.clone()
        scatter(a, source, target)
        indexing(b, source, target)
        assert torch.equal(a, b)
        for name, fn in (("scatter_", scatter), ("advanced indexing", indexing)):
            fn(buf, source, target)
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                fn(buf, source, target)
                times.append(time.perf_counter() - t0)
            out["ms"].setdefault(str(dtype).removeprefix("torch."), {})[name] = statistics.median(times) * 1e3
    out["machine"] = machine_info()
    here = Path(__file__).parent
    (here / "study.json").write_text(json.dumps(out, indent=2) + "\n")
    rows = "\n".join(f"| {d} | {v['scatter_']:.2f} | {v['advanced indexing']:.2f} |" for d, v in out["ms"].items())
    (here / "study.md").write_text(
        "# Per-row KV compaction, ms per call (median of 50)\n\n| dtype | scatter_ | advanced indexing |\n"
        f"| --- | --- | --- |\n{rows}\n\nCommand: `OMP_NUM_THREADS=1 python benchmarks/results/kv-compaction/study.py`"
        f"\n\nMachine: {machine_text(out['machine'])}.\n")


if __name__ == "__main__":
    main()
