"""Preallocated KV caches: one buffer per layer, written in place, never reallocated while generating.

:class:`BufferCache` plugs into any HF causal LM as ``past_key_values``; after a verification pass it keeps the
accepted path's entries by copying them down to the end of the context (:meth:`BufferCache.keep`).
:class:`DraftCache` is the same idea for the one-layer draft head.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class BufferLayer(DynamicLayer):
    """One layer's keys and values in [B, nkv, max_len, D] buffers; ``length`` entries are valid."""

    is_croppable = True

    def __init__(self, max_len: int):
        super().__init__()
        self.max_len = max_len
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, dk = key_states.shape
        self.keys = torch.empty(b, h, self.max_len, dk, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.empty(b, h, self.max_len, value_states.shape[-1], dtype=value_states.dtype,
                                  device=value_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.max_len:
            raise RuntimeError(f"KV cache full ({end} > {self.max_len} positions)")
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_len

    def crop(self, length: int) -> None:
        self.length = min(self.length, length) if length >= 0 else max(self.length + length, 0)

    def keep(self, start: int, index: torch.Tensor) -> None:
        """Move entries ``index`` (absolute positions, ascending, all >= start) to ``start..``; drop the rest."""
        if self.is_initialized:
            self.keys[:, :, start : start + len(index)] = self.keys[:, :, index]
            self.values[:, :, start : start + len(index)] = self.values[:, :, index]
        self.length = start + len(index)

    def reset(self) -> None:
        self.length = 0


class BufferCache(Cache):
    """A target KV cache of ``num_layers`` preallocated layers, usable as HF ``past_key_values``."""

    def __init__(self, num_layers: int, max_len: int):
        super().__init__(layers=[BufferLayer(max_len) for _ in range(num_layers)])
        self.max_len = max_len

    @property
    def length(self) -> int:
        return self.layers[0].length

    def keep(self, start: int, index: torch.Tensor) -> None:
        for layer in self.layers:
            layer.keep(start, index)

    def crop(self, length: int) -> None:
        for layer in self.layers:
            layer.crop(length)


class DraftCache:
    """The draft head's keys and values, [1, nkv, max_len, D]; tree nodes are appended and later cropped away."""

    def __init__(self, num_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.keys = torch.empty(1, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        if end > self.keys.shape[2]:
            raise RuntimeError(f"draft KV cache full ({end} > {self.keys.shape[2]} positions)")
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]
