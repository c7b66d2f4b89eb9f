"""Matmul kernels for small inputs on CPU, chosen by measurement on each machine.

A verification pass runs the target over a handful of tokens, a plain decode step over one. How fast BLAS multiplies
so few rows depends on the CPU: on an AMD EPYC (MKL) ``F.linear`` (x @ W^T) over 2-8 rows was slow and the same
product computed weight-major, (W @ x^T)^T, brought a four-token forward from 1.5x to 0.72x a one-token one
(``benchmarks/results/engine.md``); on an Intel Xeon the one-row kernel that won on the EPYC ran 2.1x slower than
``F.linear`` (``benchmarks/results/intel-xeon/plain-kernel.md``). A third kernel, oneDNN's linear over a copy of the
weight packed for it once (``torch.ops.mkldnn``, what inductor's CPU freezing uses), keeps a few rows nearly as cheap
as one in fp32 too; the copy costs memory equal to the switched weights.

:class:`WeightMajorLinears` switches a model's ``nn.Linear`` layers, while it is entered, to a chosen kernel for one
row (``one_row``) and others for 2..``max_rows`` rows (``rows_kernel``: one kernel, or one per row count); other
inputs (a long prompt) take ``F.linear``. The result is the same product summed in another order, as any change of
batch size already does.

:func:`choose_kernels` picks them for a model on this machine: it times every switched layer of the model on 1..32
rows with each kernel, in turns (about 10 s, once), takes the fastest kernel at each row count (:func:`pick`), and
caches the choice per CPU, torch build, thread count, dtype and layer shapes under ``<griffin cache>/kernels/``.
Models whose linear weights fit in a CPU cache (the tiny test models) are not measured and take
:data:`ONE_ROW_DEFAULTS` and :data:`DEFAULT_MAX_ROWS` weight-major rows.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import statistics
import time
import types
import weakref
from dataclasses import asdict, dataclass

import numpy
import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)
RowsKernel = str | tuple[str, ...]  # the kernel of 2..max_rows rows, or one per row count (index: rows - 2)


def _onednn_packs(weight: torch.Tensor) -> bool:
    """Whether this torch build packs and multiplies a weight of this dtype with oneDNN."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach()[:2, :2].contiguous(), 1)
        return torch.ops.mkldnn._linear_pointwise(weight.new_ones(1, 2), packed, None, "none", [], "").shape == (1, 2)
    except (AttributeError, NotImplementedError, RuntimeError):  # no such operator, or not for this dtype
        return False


ONEDNN = torch.backends.mkldnn.is_available() and _onednn_packs(torch.ones(2, 2))  # elsewhere: not offered
ONE_ROW_KERNELS = ("linear", "weight-major", "pad") + (("onednn",) if ONEDNN else ())
ROWS_KERNELS = ("weight-major",) + (("onednn",) if ONEDNN else ())
# Unmeasured fallbacks (models too small to measure): the AMD EPYC's winners (benchmarks/results/plain-kernel.md and
# engine.md; at 8 rows weight-major still won there, 1.24x against 1.42x a one-row forward).
ONE_ROW_DEFAULTS = {torch.float32: "pad", torch.bfloat16: "weight-major"}
DEFAULT_MAX_ROWS = 8
ROW_SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32)  # the multi-row sizes timed: verification passes of trees and chains
MEASURE_MIN_BYTES = 32 << 20  # smaller linear weights stay in cache: launch costs, not the kernel, decide
BUDGET_S = 10.0
PACK_ROWS = 8  # the row count oneDNN packs the weight for (any count works; this one is what verification sees)

_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nn.Linear -> (weight stamp, packed weight)


def packed_weight(m: nn.Linear) -> torch.Tensor:
    """``m``'s weight packed for oneDNN, made once and again only if the weight changed."""
    weight = m._parameters["weight"]  # not m.weight: nn.Module.__getattr__ is slow, and this runs per layer per pass
    stamp = (weight.data_ptr(), weight._version, weight.dtype)
    hit = _PACKED.get(m)
    if hit is None or hit[0] != stamp:
        with torch.no_grad():
            hit = _PACKED[m] = (stamp, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS))
    return hit[1]


_SWITCHED = ("forward", "max_rows", "one_row", "by_rows", "packed")  # what WeightMajorLinears sets on each layer


def _small_input_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    kernel = self.one_row if rows == 1 else self.by_rows[rows - 2] if 2 <= rows <= self.max_rows else "linear"
    if kernel == "linear":
        return F.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, -1)
    if kernel == "onednn":
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")  # [rows, out]
        return out.reshape(*x.shape[:-1], -1)
    if kernel == "pad":  # two rows, the second a copy, through the 2-row weight-major product
        out = (self.weight @ flat.repeat(2, 1).T)[:, :1].T.contiguous()  # [1, out]
    else:
        out = (self.weight @ flat.T).T.contiguous()  # [rows, out]
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], -1)


class WeightMajorLinears:
    """``with WeightMajorLinears(model, max_rows, one_row, rows_kernel):`` computes the model's linear layers with
    other kernels than ``F.linear`` for small inputs.

    Only plain ``nn.Linear`` modules are switched: quantized or fused subclasses keep their own kernels, and modules
    whose ``forward`` is already wrapped (accelerate's offload hooks) are left alone. Nothing is switched when
    ``max_rows`` < 2 and ``one_row`` is ``"linear"``. Entering and leaving costs a few dict writes per layer.

    Kernels (:data:`ONE_ROW_KERNELS`): ``"linear"`` (``F.linear``), ``"weight-major"`` ((W @ x^T)^T), ``"pad"`` (one
    row and a copy of it through the two-row weight-major product) and ``"onednn"`` (oneDNN's linear over the weight
    packed for it, :func:`packed_weight`). ``one_row`` is the kernel of a one-row input (a plain decode step);
    ``rows_kernel`` that of 2..``max_rows`` rows: one of :data:`ROWS_KERNELS`, or a tuple with the kernel of each row
    count from 2 on (``"linear"`` allowed; its last entry covers larger counts up to ``max_rows``).
    """

    def __init__(self, model: nn.Module, max_rows: int, one_row: str = "linear",
                 rows_kernel: RowsKernel = "weight-major"):
        if one_row not in ONE_ROW_KERNELS:
            raise ValueError(f"one_row must be one of {', '.join(ONE_ROW_KERNELS)}, got {one_row!r}")
        allowed = ROWS_KERNELS if isinstance(rows_kernel, str) else ("linear", *ROWS_KERNELS)
        table = (rows_kernel,) if isinstance(rows_kernel, str) else tuple(rows_kernel)
        if not table or any(k not in allowed for k in table):
            raise ValueError(f"rows_kernel must be one of {', '.join(ROWS_KERNELS)} or a tuple of those and "
                             f"'linear', got {rows_kernel!r}")
        self.max_rows, self.one_row, self.rows_kernel = max_rows, one_row, rows_kernel
        self.by_rows = (table + table[-1:] * max(0, max_rows - 1 - len(table)))[: max(0, max_rows - 1)]
        active = one_row != "linear" or any(k != "linear" for k in self.by_rows)
        self.linears = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in vars(m)
                        and m.weight.device.type != "meta"] if active else []
        self.onednn = one_row == "onednn" or "onednn" in self.by_rows

    def describe(self) -> str:
        """The kernels in words, e.g. ``one row pad; 2 rows weight-major, 3-32 rows onednn``."""
        return f"one row {self.one_row}; " + describe_rows(self.by_rows)

    def __enter__(self) -> WeightMajorLinears:
        # straight into each module's __dict__: nn.Module.__setattr__ / __delattr__ would store the same, at ~15 µs per
        # layer per pass, which a one-token step of a 30-layer model pays 3 ms for
        for m in self.linears:
            vars(m).update(max_rows=self.max_rows, one_row=self.one_row, by_rows=self.by_rows,
                           packed=packed_weight(m) if self.onednn else None,
                           forward=types.MethodType(_small_input_forward, m))
        return self

    def __exit__(self, *exc) -> None:
        for m in self.linears:
            attributes = vars(m)
            for name in _SWITCHED:
                del attributes[name]


def describe_rows(by_rows: tuple[str, ...]) -> str:
    """Kernels of 2, 3, ... rows in words, runs of the same kernel merged: ``2 rows weight-major, 3-32 rows onednn``
    (``F.linear`` beyond)."""
    runs: list[list] = []  # [first rows, last rows, kernel]
    for rows, kernel in enumerate(by_rows, start=2):
        if runs and runs[-1][2] == kernel:
            runs[-1][1] = rows
        else:
            runs.append([rows, rows, kernel])
    parts = [f"{a}{'' if a == b else f'-{b}'} rows {k}" for a, b, k in runs if k != "linear"]
    return ", ".join(parts) if parts else "more rows linear"


@dataclass(frozen=True)
class KernelChoice:
    """The kernel of one-row inputs, the largest input a small-rows kernel takes (0: none) and the kernels of 2..
    ``max_rows`` rows (one, or one per row count), with where they came from."""

    one_row: str
    max_rows: int
    rows_kernel: RowsKernel
    source: str  # "measured", "cached", "default" (not measured) or "gpu"


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in ``/proc/cpuinfo``; None where there is none."""
    try:
        with open("/proc/cpuinfo") as handle:
            return next(line.split(":", 1)[1].strip() for line in handle if line.startswith(field))
    except (OSError, StopIteration):
        return None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


# the extensions that set CPU matrix kernels apart
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def cpu_flags() -> list[str]:
    """The CPU's matrix and vector extensions among ``VECTOR_FLAGS`` (``/proc/cpuinfo``); empty where unknown."""
    flags = (_cpuinfo("flags") or "").split()
    return [f for f in VECTOR_FLAGS if f in flags]


def _switched(model: nn.Module) -> list[nn.Linear]:
    return WeightMajorLinears(model, DEFAULT_MAX_ROWS, "weight-major").linears


def _key(linears: list[nn.Linear], dtype: torch.dtype) -> str:
    shapes = sorted(f"{m.out_features}x{m.in_features}{'b' if m.bias is not None else ''}" for m in linears)
    parts = [cpu_name(), torch.__version__, str(torch.get_num_threads()), str(dtype), ",".join(shapes),
             str(ROW_SIZES), ",".join(ONE_ROW_KERNELS), "per row count"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


@torch.inference_mode()
def measure_kernels(model: nn.Module, budget_s: float = BUDGET_S, min_rounds: int = 3) -> dict:
    """Median seconds to run every switched linear layer of ``model`` once, per kernel and input rows.

    -> {"one_row_s": {kernel: s}, "rows": {n: {kernel: s}}, "rounds": r}, multi-row kernels being ``linear`` and
    :data:`ROWS_KERNELS` (oneDNN only where it takes the model's dtype). All timings of a round are interleaved in a
    rotated order, so load from other processes falls on all of them alike; rounds stop at the budget (at least
    ``min_rounds``)."""
    linears = _switched(model)
    weight = linears[0].weight
    inputs = {d: torch.randn(max(ROW_SIZES), d, dtype=weight.dtype, device=weight.device,
                             generator=torch.Generator(weight.device).manual_seed(0))
              for d in {m.in_features for m in linears}}
    offered = [k for k in ONE_ROW_KERNELS if k != "onednn" or _onednn_packs(weight)]
    switches = {("one_row", k): WeightMajorLinears(model, 0, k) for k in offered}
    for n in ROW_SIZES:
        switches[n, "linear"] = WeightMajorLinears(model, 0)
        switches.update({(n, k): WeightMajorLinears(model, max(ROW_SIZES), "linear", k)
                         for k in ROWS_KERNELS if k in offered})

    def run(case: tuple) -> float:
        rows = 1 if case[0] == "one_row" else case[0]
        with switches[case]:
            t0 = time.perf_counter()
            for m in linears:
                m(inputs[m.in_features][:rows])
            return time.perf_counter() - t0

    cases = list(switches)
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    for case in cases:  # warm-up: first-call allocations, weight packing
        run(case)
    deadline, rounds = time.perf_counter() + budget_s, 0
    while rounds < min_rounds or time.perf_counter() < deadline:
        shift = rounds % len(cases)
        for case in cases[shift:] + cases[:shift]:
            times[case].append(run(case))
        rounds += 1
    median = {c: statistics.median(t) for c, t in times.items()}
    return {"one_row_s": {k: median["one_row", k] for k in offered},
            "rows": {n: {k: median[n, k] for k in ("linear", *ROWS_KERNELS) if k in offered or k == "linear"}
                     for n in ROW_SIZES}, "rounds": rounds}


def pick(measured: dict) -> tuple[str, int, RowsKernel]:
    """-> (the fastest one-row kernel, the largest row count at which another kernel beats ``F.linear`` (0: none),
    the fastest kernel at each row count from 2 to it). Row counts between two measured sizes take the kernel with
    the least time interpolated between them."""
    one_row = min(measured["one_row_s"], key=lambda k: measured["one_row_s"][k])
    sizes = sorted(measured["rows"].items(), key=lambda kv: int(kv[0]))
    counts = [int(n) for n, _ in sizes]
    kernels = list(sizes[0][1])
    times = {k: numpy.interp(range(2, counts[-1] + 1), counts, [t[k] for _, t in sizes]) for k in kernels}
    by_rows = [min(kernels, key=lambda k: (times[k][i], k != "linear")) for i in range(counts[-1] - 1)]
    while by_rows and by_rows[-1] == "linear":
        by_rows.pop()
    if not by_rows:
        return one_row, 0, "weight-major"
    return one_row, len(by_rows) + 1, by_rows[0] if len(set(by_rows)) == 1 else tuple(by_rows)


_CHOICES: dict[str, KernelChoice] = {}


def choose_kernels(model: nn.Module, remeasure: bool = False) -> KernelChoice:
    """The kernels for ``model``'s small inputs on this machine: measured once (:func:`measure_kernels`), then cached
    on disk; GPUs keep ``F.linear`` (their BLAS already handles a few rows well)."""
    from .io import read_cached, write_cached
    from .target import cache_dir

    linears = _switched(model)
    if not linears:
        return KernelChoice("linear", 0, "weight-major", "default")
    weight = linears[0].weight
    if weight.device.type != "cpu":
        return KernelChoice("linear", 0, "weight-major", "gpu")
    if sum(m.weight.numel() * m.weight.element_size() for m in linears) < MEASURE_MIN_BYTES:
        return KernelChoice(ONE_ROW_DEFAULTS.get(weight.dtype, "linear"), DEFAULT_MAX_ROWS, "weight-major", "default")
    key = _key(linears, weight.dtype)
    if key in _CHOICES and not remeasure:
        return _CHOICES[key]
    path = cache_dir() / "kernels" / f"{key}.json"
    cached = None if remeasure else read_cached(path, "kernel choice", cached_choice, "measuring the kernels again")
    if cached is not None:
        _CHOICES[key] = cached
        return cached
    log.info("timing matmul kernels for this machine and model (about %.0f s, once)", BUDGET_S)
    t0 = time.perf_counter()
    measured = measure_kernels(model, BUDGET_S)
    choice = _CHOICES[key] = KernelChoice(*pick(measured), "measured")
    record = {**asdict(choice), **measured, "cpu": cpu_name(), "threads": torch.get_num_threads(),
              "dtype": str(weight.dtype), "torch": torch.__version__, "measure_s": time.perf_counter() - t0,
              "measured_at": time.strftime("%Y-%m-%d %H:%M")}
    cached_in = f"cached in {path}" if write_cached(path, record, "kernel choice") else "not cached"
    log.info("kernels: %s (measured in %.0f s, %s)",
             WeightMajorLinears(model, choice.max_rows, choice.one_row, choice.rows_kernel).describe(),
             record["measure_s"], cached_in)
    return choice


def cached_choice(record: dict) -> KernelChoice:
    """The choice a kernel record holds; ValueError naming the field if it is not one this build can run."""
    from .io import check_integer

    rows_kernel = record["rows_kernel"]
    if not isinstance(rows_kernel, str) and not (isinstance(rows_kernel, list)
                                                 and all(isinstance(k, str) for k in rows_kernel)):
        raise ValueError(f"rows_kernel is {rows_kernel!r}, not a kernel name or a list of them")
    choice = KernelChoice(record["one_row"], check_integer(record, "max_rows", 0, max(ROW_SIZES)),
                          rows_kernel if isinstance(rows_kernel, str) else tuple(rows_kernel), "cached")
    WeightMajorLinears(nn.Module(), choice.max_rows, choice.one_row, choice.rows_kernel)  # unknown kernels: ValueError
    return choice
