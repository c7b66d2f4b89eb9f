"""Preallocated KV caches, written in place, never reallocated while generating.

:class:`BufferCache` plugs into any HF causal LM as its KV cache (:func:`cached_forward`). All layers' keys and
values live in one [L, 2, B, nkv, max_len, D] buffer (a layer whose shapes differ from the others gets its own), so
that keeping the accepted path's entries after a verification pass is one index copy (:meth:`BufferCache.keep`). The
buffer is kept for the next generation when it is large enough (:meth:`BufferCache.prepare`). :class:`DraftCache` is
the same idea for the one-layer draft head.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer

_KEYWORDS: dict[type, str] = {}  # decoder class -> its cache keyword (a plain dict: torch.compile traces through it)


def cache_keyword(decoder_type: type) -> str:
    """The keyword of a decoder's KV cache: ``cache`` from transformers 5.24 on (``past_key_values`` warns there on
    every call and goes in 5.40), ``past_key_values`` before."""
    if decoder_type not in _KEYWORDS:
        names = inspect.signature(decoder_type.forward).parameters
        _KEYWORDS[decoder_type] = "cache" if "cache" in names else "past_key_values"
    return _KEYWORDS[decoder_type]


def cached_forward(decoder: torch.nn.Module, cache: Cache, **inputs):
    """``decoder(**inputs)`` attending over and extending ``cache``, in any transformers 5.x."""
    return decoder(**inputs, **{cache_keyword(type(decoder)): cache}, use_cache=True)


class BufferLayer(DynamicLayer):
    """One layer's keys and values: [B, nkv, max_len, D] views into its cache's buffer; ``length`` entries are valid."""

    is_croppable = True

    def __init__(self, cache: BufferCache, index: int):
        super().__init__()
        self.cache, self.index = cache, index
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = self.cache.storage(self.index, key_states, value_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.cache.static:  # write at the device-side offset, attend over the whole buffer (the mask hides the rest)
            index = self.cache.offset + torch.arange(key_states.shape[-2], device=self.keys.device)
            self.keys.index_copy_(2, index, key_states)
            self.values.index_copy_(2, index, value_states)
            return self.keys, self.values
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            raise RuntimeError(f"KV cache full ({end} > {self.keys.shape[-2]} positions)")
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.cache.max_len

    def crop(self, length: int) -> None:
        self.length = min(self.length, length) if length >= 0 else max(self.length + length, 0)

    def reset(self) -> None:
        self.length = 0


class BufferCache(Cache):
    """A target KV cache of ``num_layers`` preallocated layers, usable as any HF decoder's cache."""

    def __init__(self, num_layers: int, max_len: int):
        super().__init__(layers=[BufferLayer(self, i) for i in range(num_layers)])
        self.max_len = max_len
        self.buffers: list[torch.Tensor] = []  # position axis -2; buffers[0]: the one shared by equal layers
        # static mode (compiled verification): updates write at `offset`, a 0-dim device tensor, and return the whole
        # buffer, so that every pass has the same shapes and addresses; the host-side lengths are kept by the caller
        self.static = False
        self.offset: torch.Tensor | None = None

    def storage(self, index: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s [B, nkv, max_len, D] key and value views, allocated on the first update."""
        shape = (*key.shape[:-2], self.max_len, key.shape[-1])
        same = value.shape[:-2] == key.shape[:-2] and value.shape[-1] == key.shape[-1]
        if not self.buffers and same:
            # zeros, not empty: static passes attend over the whole buffer, where a NaN of old memory would poison
            # the masked scores
            self.buffers.append(torch.zeros(len(self.layers), 2, *shape, dtype=key.dtype, device=key.device))
        shared = self.buffers[0] if self.buffers else None
        if (shared is not None and same and shared.shape[2:] == shape and shared.dtype == key.dtype
                and shared.device == key.device):
            return shared[index, 0], shared[index, 1]
        keys = torch.zeros(shape, dtype=key.dtype, device=key.device)
        values = torch.zeros((*value.shape[:-2], self.max_len, value.shape[-1]), dtype=value.dtype, device=key.device)
        self.buffers += [keys, values]
        return keys, values

    def advance(self, n: int) -> None:
        """Count ``n`` entries written in static mode."""
        for layer in self.layers:
            layer.length += n

    def prepare(self, max_len: int) -> None:
        """Empty the cache for a new sequence of up to ``max_len`` positions, keeping the buffers if they fit."""
        if max_len > self.max_len:
            self.max_len = max_len
            self.buffers = []
            for layer in self.layers:
                layer.keys = layer.values = None
                layer.is_initialized = False
        for layer in self.layers:
            layer.length = 0

    @property
    def length(self) -> int:
        return self.layers[0].length

    def keep(self, start: int, index: torch.Tensor) -> None:
        """Move entries ``index`` [m] (absolute positions, each >= start) to ``start..start+m``; the cache then ends
        there. One index copy per buffer (one in all for most models); nothing waits for the device."""
        m = index.shape[0]
        for buf in self.buffers:
            buf[..., start : start + m, :] = buf[..., index, :]
        for layer in self.layers:
            layer.length = start + m

    def crop(self, length: int) -> None:
        for layer in self.layers:
            layer.crop(length)


def move_entries(buf: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> None:
    """In ``buf`` [.., B, nkv, S, D], copy each row's entries at slots ``source`` [B, m] to slots ``target`` [B, m]
    (all read before any is written). Advanced indexing, not ``scatter_``: on the CPU a bf16 scatter costs a copy of
    the whole buffer."""
    rows = torch.arange(source.shape[0], device=source.device)[:, None]  # [B, 1]
    buf[..., rows, :, target, :] = buf[..., rows, :, source, :]  # [B, m, .., nkv, D] moved


class RowsCache(BufferCache):
    """A target KV cache of B rows of different lengths (batched generation, :mod:`griffin.batch`).

    Row b's entries are slots ``0..lengths[b]-1`` of its row; a forward writes every row's new entries at the same
    slots from :attr:`end` (the longest row) on, and its attention mask hides each shorter row's gap (the slots
    between its length and ``end``). :meth:`compact` then moves each row's kept entries right after its own length.
    """

    def __init__(self, num_layers: int, max_len: int):
        super().__init__(num_layers, max_len)
        self.lengths: list[int] = []  # per row, on the host: where the next forward writes (``end``)
        self.where: dict[int, tuple[int, int | None]] = {}  # layer -> (its buffer, its index there; None: own pair)

    @property
    def lengths(self) -> list[int]:
        return self._lengths

    @lengths.setter
    def lengths(self, value: list[int]) -> None:
        self._lengths = list(value)
        self._on_device: torch.Tensor | None = None  # the same lengths on the device, uploaded once

    def storage(self, index: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        before = len(self.buffers)
        keys, values = super().storage(index, key, value)
        own = len(self.buffers) == before + 2
        self.where[index] = (len(self.buffers) - 2, None) if own else (0, index)
        return keys, values

    def fill(self, row: int, source: BufferCache) -> None:
        """Copy the entries of a one-row cache (a prefill of row ``row`` alone) into row ``row``, from slot 0."""
        n = source.length
        for layer, src in zip(self.layers, source.layers, strict=True):
            if not layer.is_initialized:  # shapes from the source, with this cache's rows
                rows = len(self.lengths)
                layer.lazy_initialization(src.keys[:, :, :0].expand(rows, -1, -1, -1),
                                          src.values[:, :, :0].expand(rows, -1, -1, -1))
            layer.keys[row, :, :n] = src.keys[0, :, :n]
            layer.values[row, :, :n] = src.values[0, :, :n]
        self.lengths = self.lengths[:row] + [n] + self.lengths[row + 1 :]
        self.crop_to_rows()

    @property
    def end(self) -> int:
        return max(self.lengths)

    def crop_to_rows(self) -> None:
        """Every layer's length to :attr:`end`: where the next forward writes."""
        for layer in self.layers:
            layer.length = self.end

    def positions(self, device: torch.device) -> torch.Tensor:
        """[B] each row's length (the position of its next token) on ``device``: uploaded once, then moved there by
        :meth:`compact`'s device counts, so that a cycle sends nothing to the device."""
        if self._on_device is None or self._on_device.device != device:
            self._on_device = torch.tensor(self.lengths, device=device)
        return self._on_device

    def valid(self, device: torch.device) -> torch.Tensor:
        """[B, end] bool: the slots each row's entries occupy."""
        return torch.arange(self.end, device=device)[None, :] < self.positions(device)[:, None]

    def compact(self, source: torch.Tensor, counts: list[int], device_counts: torch.Tensor) -> None:
        """Keep entries ``source`` [B, m] (slots written by the last forward, each row's own) as slots
        ``lengths[b]..lengths[b]+m-1`` of their row, then count the first ``counts[b]`` of them (``device_counts``
        [B]: the same counts, still on the device). One gather and one scatter per buffer (one buffer for most
        models); nothing waits for the device."""
        lengths = self.positions(source.device)
        target = lengths[:, None] + torch.arange(source.shape[1], device=source.device)  # [B, m]
        for buf in self.buffers:
            move_entries(buf, source, target)
        self.lengths = [n + c for n, c in zip(self.lengths, counts, strict=True)]
        self._on_device = lengths + device_counts
        self.crop_to_rows()

    def select(self, rows: list[int]) -> None:
        """Keep only ``rows`` (finished rows stop costing compute): a copy of each buffer's kept rows."""
        keep = torch.tensor(rows, device=self.buffers[0].device)
        self.buffers = [buf.index_select(buf.dim() - 4, keep) for buf in self.buffers]
        for i, layer in enumerate(self.layers):
            buf, index = self.where[i]
            if index is None:
                layer.keys, layer.values = self.buffers[buf], self.buffers[buf + 1]
            else:
                layer.keys, layer.values = self.buffers[buf][index, 0], self.buffers[buf][index, 1]
        on_device = self._on_device
        self.lengths = [self.lengths[r] for r in rows]
        if on_device is not None:
            self._on_device = on_device[keep.to(on_device.device)]
        self.crop_to_rows()


class DraftCache:
    """The draft head's keys and values, [B, nkv, max_len, D] (B = 1 but in batched generation); tree nodes are
    appended and later cropped away."""

    def __init__(self, num_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 rows: int = 1):
        # zeros: a batch's attention masks a row's gaps, where a NaN of old memory would poison the masked scores
        self.keys = torch.zeros(rows, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        if end > self.keys.shape[2]:
            raise RuntimeError(f"draft KV cache full ({end} > {self.keys.shape[2]} positions)")
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]
