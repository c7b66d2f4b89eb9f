"""Matmul shape for verification passes on CPU.

A verification pass runs the target over a handful of tokens. On the CPU measured (MKL on an AMD EPYC), ``F.linear``
(x @ W^T) over 2-8 rows is slow: a target forward over four tokens costs 1.5x one over a single token
(``benchmarks/results/engine.md``). The same product computed weight-major, (W @ x^T)^T, brings four tokens to 0.72x.

:class:`WeightMajorLinears` switches a model's ``nn.Linear`` layers to that form while it is entered, for inputs of
2..``max_rows`` rows; other inputs (one row, a long prompt) take ``F.linear`` as before. The result is the same product
summed in another order, as any change of batch size already does.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_MAX_ROWS = 8  # engine.md: at 8 rows weight-major still wins (1.24x against 1.42x a one-row forward)


ONE_ROW_KERNELS = ("linear", "weight-major", "pad")
# The fastest one-row kernel per dtype on the CPU measured (benchmarks/results/plain-kernel.md, one thread, CPU time per
# decode step): fp32 pads to two rows (1.10x F.linear); in bf16, weight-major and F.linear are within 1 % of each other.
ONE_ROW_DEFAULTS = {torch.float32: "pad", torch.bfloat16: "weight-major"}


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


def default_max_rows(device: torch.device) -> int:
    """Weight-major small matmuls on CPU; GPUs' BLAS already handles a few rows well (0: off)."""
    return DEFAULT_MAX_ROWS if device.type == "cpu" else 0


def default_one_row(device: torch.device, dtype: torch.dtype) -> str:
    """The fastest kernel for a one-row input measured on CPU (``benchmarks/results/plain-kernel.md``); GPUs keep
    ``F.linear``."""
    if device.type != "cpu":
        return "linear"
    return ONE_ROW_DEFAULTS.get(dtype, "linear")
