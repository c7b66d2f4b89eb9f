"""The target's side of speculative decoding: prefill, verification forwards and the KV buffer they write.

:class:`TargetBackend` drives any HF causal LM through its public decoder forward. It owns one :class:`BufferCache`
(all layers in one static buffer, kept across generations when large enough), takes the verification mask and the
logits step from :mod:`griffin.family`, and runs:

- the prefill as a plain causal forward (no explicit mask: SDPA / flash attention take their causal path);
- verification passes with the tree's 4D mask. With grouped-query attention under SDPA, transformers repeats every
  KV head per query head whenever a mask is given (``repeat_kv``: a copy of the whole cache, every layer, every
  cycle; its ``enable_gqa`` path is used only without a mask on CUDA, where a masked GQA call falls back to SDPA's
  math kernel). During verification passes :class:`PackedGQA` instead folds the query heads of each KV group into
  extra query rows, [B, nh, q, D] -> [B, nkv, groups*q, D], with the mask repeated per group: the same products,
  no KV copy, and any SDPA kernel that takes a mask;
- on CPU, passes of 2..``weight_major_rows`` tokens with the small-input kernels measured fastest on this machine
  for each row count (weight-major or oneDNN linear layers; by default up to the largest count where one still
  beats ``F.linear``), and one-token passes with the one-row kernel plain decoding takes
  (:func:`griffin.kernels.choose_kernels`), so that measured costs compare like with like.

With ``compile`` (off by default) verification passes have static shapes and addresses and run through
``torch.compile`` (``compile="reduce-overhead"``: CUDA graphs): the cache writes at a device-side offset and attention
spans the whole buffer, with the family's mask padded to it; the prefill stays a plain eager forward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .family import output_logits, verification_mask
from .kernels import WeightMajorLinears, choose_kernels
from .kv_cache import BufferCache, RowsCache, cached_forward

PACKED_GQA = "griffin_packed_gqa_sdpa"
CACHE_BLOCK = 256  # KV buffers grow in steps of this many positions, so that similar requests reuse them
STATIC_MIN_LEN = 1024  # the smallest KV buffer of compiled verification


def packed_gqa_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs):
    """transformers' SDPA attention, with grouped query heads folded into query rows when a shared mask is given.

    query [B, nh, q, D], key / value [B, nkv, S, D], attention_mask [B or 1, 1, q, S] -> ([B, q, nh, D], None).
    """
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (groups == 1 or attention_mask is None or attention_mask.shape[1] != 1 or query.shape[2] == 1
             or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
             or kwargs.get("dropout", 0.0) != 0.0)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    b, nh, q, d = query.shape
    packed = query.reshape(b, nh // groups, groups * q, d)  # row r*q + i of KV group g: head g*groups + r, token i
    mask = attention_mask.repeat(1, 1, groups, 1)  # [B, 1, groups*q, S]
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)  # [B, nkv, groups*q, D]
    return out.reshape(b, nh, q, d).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_GQA, packed_gqa_sdpa)


class PackedGQA:
    """``with PackedGQA(model):`` runs the model's SDPA attention through :func:`packed_gqa_sdpa`.

    Only for models that use transformers' ``"sdpa"`` implementation and group their query heads; otherwise
    entering does nothing. Entering and leaving set the config's attention implementation (one attribute each).
    """

    def __init__(self, model: PreTrainedModel):
        text = model.config.get_text_config()
        grouped = getattr(text, "num_key_value_heads", None) not in (None, text.num_attention_heads)
        self.config = text if grouped and text._attn_implementation == "sdpa" else None

    def __enter__(self) -> PackedGQA:
        if self.config is not None:
            self.config._attn_implementation = PACKED_GQA
        return self

    def __exit__(self, *exc) -> None:
        if self.config is not None:
            self.config._attn_implementation = "sdpa"


class TargetBackend:
    """The target model's prefill and verification passes over one reusable static KV buffer."""

    def __init__(self, model: PreTrainedModel, weight_major_rows: int | None = None, packed_gqa: bool = True,
                 compile: str | dict | None = None):
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.device = model.get_input_embeddings().weight.device  # where token ids go in
        self.num_layers = model.config.get_text_config().num_hidden_layers
        # see griffin.kernels; one-token forwards (the cost model's plain step) take plain decoding's kernel
        self.kernels = choose_kernels(model)
        rows = self.kernels.max_rows if weight_major_rows is None else weight_major_rows
        self.weight_major = WeightMajorLinears(model, rows, self.kernels.one_row, self.kernels.rows_kernel)
        self.packed_gqa = PackedGQA(model) if packed_gqa else contextlib.nullcontext()
        self.cache: BufferCache | None = None
        self._cache_key: tuple | None = None
        # the target layers whose inputs a fused-feature head reads (set by the generator); None: the last hidden state
        self.feature_layers: list[int] | None = None
        # torch.compile's options for verification passes: a mode name ("reduce-overhead": CUDA graphs) or a dict
        self.compile = {"mode": compile} if isinstance(compile, str) else compile
        self._compiled = None
        self._static_ids: list[int] = []  # the tensors last marked as static inputs

    def prepare(self, max_len: int) -> BufferCache:
        """The KV cache, emptied for a sequence of up to ``max_len`` positions (its buffers reused if they fit)."""
        key = (self.lm_head.weight.dtype, self.lm_head.weight.device)
        size = -(-max_len // CACHE_BLOCK) * CACHE_BLOCK
        if self.compile is not None:  # powers of two: each new size records new graphs
            size = max(STATIC_MIN_LEN, 1 << (size - 1).bit_length())
        if self.cache is None or key != self._cache_key:
            self.cache, self._cache_key = BufferCache(self.num_layers, size), key
        self.cache.prepare(size)
        return self.cache

    def prefill(self, ids: torch.Tensor, cache: BufferCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [P] into an empty cache -> features [P, H] (or [P, 3H], see :meth:`_decode`), logits of the last position
        [1, V]. A plain causal forward."""
        cache = self.cache if cache is None else cache
        positions = torch.arange(cache.length, cache.length + ids.shape[0], device=ids.device)
        features, hidden = self._decode(cache, input_ids=ids[None], position_ids=positions[None])
        return features, output_logits(self.model, hidden[-1:])

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                cache: BufferCache | None = None, last_logits_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [q] at positions [q] after the cached entries, tree_mask [q, q] bool (which new tokens each new
        token sees; every cached entry is visible) -> features [q, H] (or [q, 3H], see :meth:`_decode`), logits
        [q, V] (or [1, V] for the last one)."""
        cache = self.cache if cache is None else cache
        if self.compile is not None and cache is self.cache and not last_logits_only:
            return self._static_forward(tokens, positions, tree_mask, cache)
        q = tokens.shape[0]
        mask = verification_mask(self.model, cache.length, tree_mask, self.lm_head.weight.dtype)
        small = q <= max(self.weight_major.max_rows, 1)  # one token: the one-row kernel; 2..max_rows: their kernels
        with self.weight_major if small else contextlib.nullcontext(), self.packed_gqa:
            features, hidden = self._decode(cache, input_ids=tokens[None], position_ids=positions[None],
                                            attention_mask=mask)
            logits = output_logits(self.model, hidden[-1:] if last_logits_only else hidden)
        return features, logits

    def forward_rows(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                     cache: RowsCache) -> tuple[torch.Tensor, torch.Tensor]:
        """A verification pass of B rows (batched generation): tokens [B, q] at positions [B, q] after each row's own
        entries of ``cache``, tree_mask [B or 1, q, q] bool -> features [B, q, H] (or [B, q, 3H]), logits [B, q, V].
        The new entries go to slots ``cache.end`` on of every row; the mask hides each row's gap before them."""
        b, q = tokens.shape
        allowed = torch.cat((cache.valid(tokens.device)[:, None, :].expand(b, q, -1), tree_mask.expand(b, q, q)), -1)
        dtype = self.lm_head.weight.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=tokens.device).masked_fill_(~allowed,
                                                                                          torch.finfo(dtype).min)
        small = b * q <= max(self.weight_major.max_rows, 1)
        with self.weight_major if small else contextlib.nullcontext(), self.packed_gqa:
            out = cached_forward(self.decoder, cache, input_ids=tokens, position_ids=positions,
                                 attention_mask=mask[:, None], output_hidden_states=self.feature_layers is not None)
            hidden = out.last_hidden_state  # [B, q, H]
            logits = output_logits(self.model, hidden)
        if self.feature_layers is None:
            return hidden, logits
        return torch.cat([out.hidden_states[i] for i in self.feature_layers], dim=-1), logits

    def _decode(self, cache: BufferCache, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder over ``inputs`` (one sequence) -> (the drafter's features [q, H] or, with ``feature_layers``,
        the hidden states entering those layers concatenated [q, 3H]; the last hidden state [q, H])."""
        layers = self.feature_layers
        out = cached_forward(self.decoder, cache, **inputs, output_hidden_states=layers is not None)
        hidden = out.last_hidden_state[0]
        if layers is None:
            return hidden, hidden
        return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1), hidden

    def _static_forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                        cache: BufferCache) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` with static shapes and addresses, compiled: the same result, no per-cycle shape change."""
        n, q = cache.length, tokens.shape[0]
        dtype = self.lm_head.weight.dtype
        mask = verification_mask(self.model, n, tree_mask, dtype)  # [1, 1, q, n + q]
        mask = F.pad(mask, (0, cache.max_len - n - q), value=torch.finfo(dtype).min)  # [1, 1, q, max_len]
        if cache.offset is None or cache.offset.device != tokens.device:
            cache.offset = torch.zeros((), dtype=torch.long, device=tokens.device)
        cache.offset.fill_(n)
        static = [cache.offset, *(t for layer in cache.layers for t in (layer.keys, layer.values))]
        if [id(t) for t in static] != self._static_ids:  # new buffers: CUDA graphs may keep their addresses
            for t in static:
                torch._dynamo.mark_static_address(t)
            self._static_ids = [id(t) for t in static]
        if self._compiled is None:
            self._compiled = torch.compile(self._verification_pass, dynamic=False, **self.compile)
        cache.static = True
        torch.compiler.cudagraph_mark_step_begin()  # the last pass's outputs are dead: CUDA graphs may reuse them
        try:
            with self.packed_gqa:
                hidden, logits = self._compiled(tokens, positions, mask, cache)
        finally:
            cache.static = False
        cache.advance(q)
        return hidden, logits

    def _verification_pass(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                           cache: BufferCache) -> tuple[torch.Tensor, torch.Tensor]:
        features, hidden = self._decode(cache, input_ids=tokens[None], position_ids=positions[None],
                                        attention_mask=mask)
        return features, output_logits(self.model, hidden)
