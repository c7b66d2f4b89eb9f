"""Matmul kernels for small inputs on CPU, chosen by measurement on each machine.

A verification pass runs the target over a handful of tokens, a plain decode step over one. How fast BLAS multiplies
so few rows depends on the CPU: on an AMD EPYC (MKL) ``F.linear`` (x @ W^T) over 2-8 rows was slow and the same
product computed weight-major, (W @ x^T)^T, brought a four-token forward from 1.5x to 0.72x a one-token one
(``benchmarks/results/engine.md``); on an Intel Xeon the one-row kernel that won on the EPYC ran 2.1x slower than
``F.linear`` (``benchmarks/results/intel-xeon/plain-kernel.md``).

:class:`WeightMajorLinears` switches a model's ``nn.Linear`` layers to the weight-major form while it is entered, for
inputs of 2..``max_rows`` rows, and to a chosen kernel for one row; other inputs (a long prompt) take ``F.linear``.
The result is the same product summed in another order, as any change of batch size already does.

:func:`choose_kernels` picks ``one_row`` and ``max_rows`` for a model on this machine: it times every switched layer
of the model on 1..16 rows with each kernel, in turns (about 10 s, once), and caches the choice per CPU, torch
build, thread count, dtype and layer shapes under ``<griffin cache>/kernels/``. Models whose linear weights fit in a
CPU cache (the tiny test models) are not measured and take :data:`ONE_ROW_DEFAULTS` and :data:`DEFAULT_MAX_ROWS`.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import statistics
import time
import types
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

ONE_ROW_KERNELS = ("linear", "weight-major", "pad")
# Unmeasured fallbacks (models too small to measure): the AMD EPYC's winners (benchmarks/results/plain-kernel.md and
# engine.md; at 8 rows weight-major still won there, 1.24x against 1.42x a one-row forward).
ONE_ROW_DEFAULTS = {torch.float32: "pad", torch.bfloat16: "weight-major"}
DEFAULT_MAX_ROWS = 8
ROW_SIZES = (2, 3, 4, 5, 6, 8, 12, 16)  # the multi-row sizes timed: verification passes of small trees
MEASURE_MIN_BYTES = 32 << 20  # smaller linear weights stay in cache: launch costs, not the kernel, decide
BUDGET_S = 10.0


def _weight_major_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows == 1 and self.one_row != "linear":
        flat = x.reshape(1, -1)
        if self.one_row == "pad":  # two rows, the second a copy, through the 2-row weight-major product
            out = (self.weight @ flat.repeat(2, 1).T)[:, :1].T.contiguous()  # [1, out]
        else:
            out = (self.weight @ flat.T).T.contiguous()  # [1, out]
    elif not 2 <= rows <= self.max_rows:
        return F.linear(x, self.weight, self.bias)
    else:
        out = (self.weight @ x.reshape(rows, -1).T).T.contiguous()  # [rows, out]
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], -1)


class WeightMajorLinears:
    """``with WeightMajorLinears(model, max_rows):`` computes the model's linear layers weight-major for small inputs.

    Only plain ``nn.Linear`` modules are switched: quantized or fused subclasses keep their own kernels, and modules
    whose ``forward`` is already wrapped (accelerate's offload hooks) are left alone. Nothing is switched when
    ``max_rows`` < 2 and ``one_row`` is ``"linear"``. Entering and leaving costs one attribute write per layer.

    ``one_row`` picks the kernel of a one-row input (a plain decode step): ``"linear"`` (``F.linear``),
    ``"weight-major"`` ((W @ x^T)^T) or ``"pad"`` (the row and a copy of it through the two-row weight-major product).
    """

    def __init__(self, model: nn.Module, max_rows: int, one_row: str = "linear"):
        if one_row not in ONE_ROW_KERNELS:
            raise ValueError(f"one_row must be one of {', '.join(ONE_ROW_KERNELS)}, got {one_row!r}")
        self.max_rows, self.one_row = max_rows, one_row
        active = max_rows >= 2 or one_row != "linear"
        self.linears = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in vars(m)
                        and m.weight.device.type != "meta"] if active else []

    def __enter__(self) -> WeightMajorLinears:
        for m in self.linears:
            m.max_rows, m.one_row = self.max_rows, self.one_row
            m.forward = types.MethodType(_weight_major_forward, m)
        return self

    def __exit__(self, *exc) -> None:
        for m in self.linears:
            del m.forward, m.max_rows, m.one_row


@dataclass(frozen=True)
class KernelChoice:
    """The kernel of one-row inputs and the largest input weight-major takes (0: none), with where they came from."""

    one_row: str
    max_rows: int
    source: str  # "measured", "cached", "default" (not measured) or "gpu"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as handle:
            return next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _switched(model: nn.Module) -> list[nn.Linear]:
    return WeightMajorLinears(model, DEFAULT_MAX_ROWS, "weight-major").linears


def _key(linears: list[nn.Linear], dtype: torch.dtype) -> str:
    shapes = sorted(f"{m.out_features}x{m.in_features}{'b' if m.bias is not None else ''}" for m in linears)
    parts = [cpu_name(), torch.__version__, str(torch.get_num_threads()), str(dtype), ",".join(shapes), str(ROW_SIZES)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


@torch.inference_mode()
def measure_kernels(model: nn.Module, budget_s: float = BUDGET_S, min_rounds: int = 3) -> dict:
    """Median seconds to run every switched linear layer of ``model`` once, per kernel and input rows.

    -> {"one_row_s": {kernel: s}, "rows": {n: {"linear": s, "weight-major": s}}, "rounds": r}. All timings of a round
    are interleaved in a rotated order, so load from other processes falls on all of them alike; rounds stop at the
    budget (at least ``min_rounds``)."""
    linears = _switched(model)
    weight = linears[0].weight
    inputs = {d: torch.randn(max(ROW_SIZES), d, dtype=weight.dtype, device=weight.device,
                             generator=torch.Generator(weight.device).manual_seed(0))
              for d in {m.in_features for m in linears}}

    def run(one_row: str, max_rows: int, rows: int) -> float:
        with WeightMajorLinears(model, max_rows, one_row):
            t0 = time.perf_counter()
            for m in linears:
                m(inputs[m.in_features][:rows])
            return time.perf_counter() - t0

    cases = [("one_row", k, 0, 1) for k in ONE_ROW_KERNELS]
    cases += [(n, k, max(ROW_SIZES) if k == "weight-major" else 0, n) for n in ROW_SIZES
              for k in ("linear", "weight-major")]
    times: dict[tuple, list[float]] = {c[:2]: [] for c in cases}
    for _, kernel, max_rows, rows in cases:  # warm-up: first-call allocations
        run(kernel if rows == 1 else "linear", max_rows, rows)
    deadline, rounds = time.perf_counter() + budget_s, 0
    while rounds < min_rounds or time.perf_counter() < deadline:
        shift = rounds % len(cases)
        for group, kernel, max_rows, rows in cases[shift:] + cases[:shift]:
            times[group, kernel].append(run(kernel if rows == 1 else "linear", max_rows, rows))
        rounds += 1
    median = {c: statistics.median(t) for c, t in times.items()}
    return {"one_row_s": {k: median["one_row", k] for k in ONE_ROW_KERNELS},
            "rows": {n: {k: median[n, k] for k in ("linear", "weight-major")} for n in ROW_SIZES}, "rounds": rounds}


def pick(measured: dict) -> tuple[str, int]:
    """-> (the fastest one-row kernel, the largest row count up to which weight-major beats ``F.linear`` at every
    measured size; 0 if it loses at 2 rows)."""
    one_row = min(ONE_ROW_KERNELS, key=lambda k: measured["one_row_s"][k])
    max_rows = 0
    for n, t in sorted(measured["rows"].items(), key=lambda kv: int(kv[0])):
        if t["weight-major"] >= t["linear"]:
            break
        max_rows = int(n)
    return one_row, max_rows


_CHOICES: dict[str, KernelChoice] = {}


def choose_kernels(model: nn.Module, remeasure: bool = False) -> KernelChoice:
    """The kernels for ``model``'s small inputs on this machine: measured once (:func:`measure_kernels`), then cached
    on disk; GPUs keep ``F.linear`` (their BLAS already handles a few rows well)."""
    from .io import atomic_write_json, read_json
    from .target import cache_dir

    linears = _switched(model)
    if not linears:
        return KernelChoice("linear", 0, "default")
    weight = linears[0].weight
    if weight.device.type != "cpu":
        return KernelChoice("linear", 0, "gpu")
    if sum(m.weight.numel() * m.weight.element_size() for m in linears) < MEASURE_MIN_BYTES:
        return KernelChoice(ONE_ROW_DEFAULTS.get(weight.dtype, "linear"), DEFAULT_MAX_ROWS, "default")
    key = _key(linears, weight.dtype)
    if key in _CHOICES and not remeasure:
        return _CHOICES[key]
    path = cache_dir() / "kernels" / f"{key}.json"
    if path.is_file() and not remeasure:
        try:
            record = read_json(path, "kernel choice")
            choice = _CHOICES[key] = KernelChoice(record["one_row"], int(record["max_rows"]), "cached")
            return choice
        except (ValueError, KeyError, TypeError):
            log.warning("%s is damaged: measuring the kernels again", path)
    log.info("timing matmul kernels for this machine and model (about %.0f s, once)", BUDGET_S)
    t0 = time.perf_counter()
    measured = measure_kernels(model, BUDGET_S)
    choice = _CHOICES[key] = KernelChoice(*pick(measured), "measured")
    record = {**asdict(choice), **measured, "cpu": cpu_name(), "threads": torch.get_num_threads(),
              "dtype": str(weight.dtype), "torch": torch.__version__, "measure_s": time.perf_counter() - t0,
              "measured_at": time.strftime("%Y-%m-%d %H:%M")}
    atomic_write_json(path, record)
    log.info("kernels: one row %s, weight-major up to %d rows (measured in %.0f s, cached in %s)", choice.one_row,
             choice.max_rows, record["measure_s"], path)
    return choice
