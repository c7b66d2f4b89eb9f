"""What a target family decides beyond its decoder: the attention mask of a verification pass and the logits step.

Every place that turns target hidden states into logits (verification, plain decoding, training soft labels) calls
:func:`output_logits` or :func:`logits_transform`, and every verification forward takes its mask from
:func:`verification_mask`, so that a family whose logits or masks differ from Llama's is handled (or refused) in one
place. Handled today:

- sliding-window attention: every layer (Mistral with ``sliding_window``, Phi-3, Starcoder2) or some layers (Qwen2 with
  ``use_sliding_window``, Gemma-2/3, Cohere-2 ``layer_types``): windowed masks, one per layer type;
- a logits step after the output layer: Cohere's ``logit_scale`` (multiply), Granite's ``logits_scaling`` (divide),
  Gemma-2/3's ``final_logit_softcapping``.

Anything else a family does differently is caught by :func:`check_target`, which compares one tree verification with
the model's own forward the first time a model is used, and refuses the target with the family's name if they differ.

"Identical" is always meant like with like: the same model, dtype, device and attention implementation as the
``generate`` it is compared with. On a GPU :func:`griffin.target.load_target` defaults to bf16; in bf16 or fp16 a
verification pass computes the same positions as ``generate`` but in other matrix shapes, so logits can differ in their
last bits and a greedy near-tie can go the other way (``generate`` itself changes in the same way with the batch size).
fp32 targets give the same tokens as ``generate`` (the tests check it on every family above).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

MASK_KINDS = ("full_attention", "sliding_attention")
_CHECK_WINDOW = 4  # the window the load-time check slides with (short, so that it cuts into its 12 tokens)


class UnsupportedTarget(ValueError):
    """The target family's output cannot be reproduced by tree verification (the message says why)."""


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def family_name(config) -> str:
    return getattr(_text_config(config), "model_type", None) or type(config).__name__


def attention_windows(config) -> list[int | None]:
    """The attention window of every layer (None: full causal attention), or :class:`UnsupportedTarget`."""
    cfg = _text_config(config)
    family = family_name(config)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedTarget(f"{family}: encoder-decoder models are not supported; use a decoder-only causal LM")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedTarget(f"{family}: this configuration attends bidirectionally, so it does not generate "
                                "left to right; use a causal LM configuration")
    window = getattr(cfg, "sliding_window", None)
    layers = cfg.num_hidden_layers
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        return [window] * layers  # Mistral-style: every layer slides when the config sets a window
    unknown = sorted(set(layer_types) - set(MASK_KINDS))
    if unknown:
        raise UnsupportedTarget(f"{family}: layers of type {unknown} (not plain or sliding-window attention) cannot "
                                "be verified as a tree yet")
    if "sliding_attention" in layer_types and not window:
        raise UnsupportedTarget(f"{family}: sliding-window layers without a sliding_window size in the config")
    return [window if kind == "sliding_attention" else None for kind in layer_types[:layers]]


def window_crossed(config, positions: int) -> bool:
    """Whether ``positions`` cached positions cross some layer's sliding attention window (the batched rows' cache
    keeps every position, so batches refuse that)."""
    return any(w is not None and w < positions for w in attention_windows(config))


def logits_transform(config) -> Callable[[torch.Tensor], torch.Tensor]:
    """The family's step from output-layer logits to the model's logits (identity for most families).

    Applied after ``hidden @ lm_head.T`` for any subset of the lm_head rows (the step is elementwise): Cohere's
    ``logit_scale`` multiplies, Granite's ``logits_scaling`` divides, Gemma-2/3's ``final_logit_softcapping`` caps
    with ``cap * tanh(x / cap)``, exactly as their ``forward`` does.
    """
    cfg = _text_config(config)
    scale = getattr(cfg, "logit_scale", None)
    divide = getattr(cfg, "logits_scaling", None)
    cap = getattr(cfg, "final_logit_softcapping", None)
    if scale is None and divide is None and cap is None:
        return _identity

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return transform


def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [.., H] (the decoder's final-norm output) -> logits [.., V] exactly as the model's own forward."""
    return logits_transform(model.config)(model.get_output_embeddings()(hidden))


def verification_mask(model, past: int, allowed: torch.Tensor, dtype: torch.dtype,
                      positions: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive attention mask of q new tokens after ``past`` cached ones.

    allowed [q, q] bool: which new tokens each new token may see (all cached entries are visible, subject to the
    layer's window) -> [1, 1, q, past + q] with 0 where allowed and the dtype's minimum elsewhere; for a target whose
    layers differ (some sliding, some full) a dict of such masks per layer type, which those models' forward accepts.
    Cached entry i sits at position i. ``positions`` [q] of the new tokens default to ``past`` + their depth among the
    new tokens (the number of new tokens they see, minus one), which holds for causal chunks and draft trees alike.
    """
    q = allowed.shape[0]
    minimum = torch.finfo(dtype).min
    mask = torch.zeros(1, 1, q, past + q, dtype=dtype, device=allowed.device)
    mask[0, 0, :, past:].masked_fill_(~allowed, minimum)
    windows = set(attention_windows(model.config))
    if windows == {None}:
        return mask
    if positions is None:
        positions = past + allowed.sum(-1) - 1  # [q]
    window = next(w for w in windows if w is not None)
    keys = torch.cat((torch.arange(past, device=allowed.device), positions.to(allowed.device)))  # [past + q]
    slid = mask.masked_fill(keys[None, None, None, :] <= positions[None, None, :, None] - window, minimum)
    if len(windows) == 1:
        return slid
    return {"full_attention": mask, "sliding_attention": slid}


@contextlib.contextmanager
def _window(config, size: int):
    """Temporarily shrink the sliding window of a config that has one (the check's sequences are short)."""
    cfg = _text_config(config)
    old = getattr(cfg, "sliding_window", None)
    if old:
        cfg.sliding_window = size
    try:
        yield
    finally:
        if old:
            cfg.sliding_window = old


@torch.inference_mode()
def check_target(model) -> None:
    """Refuse, with the family and the reason, a target whose tree verification would not give its own logits.

    Runs once per model (a few forwards over 12 tokens): a 6-token prefill into the engine's cache, then a two-branch
    tree on top of it, against the model's own forward over each branch (with the sliding window, if any, shortened
    to 4 tokens so that it matters).
    """
    if getattr(model, "_griffin_target_checked", False):
        return
    family = family_name(model.config)
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        raise UnsupportedTarget(f"{family}: attention implementation {implementation!r} ignores the tree mask; load "
                                "the target with attn_implementation='sdpa' (or call model.set_attn_implementation("
                                "'sdpa'))")
    attention_windows(model.config)
    from .kv_cache import BufferCache, cached_forward

    device = next(model.parameters()).device
    dtype = model.get_output_embeddings().weight.dtype
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (12,), generator=torch.Generator().manual_seed(0)).to(device)
    branch_b = ids[9:12]  # a second branch under the root ids[6], beside ids[7:9]
    tree = torch.cat((ids[6:9], branch_b[:2]))  # root, a1, a2, b1, b2
    allowed = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]],
                           dtype=torch.bool, device=device)
    depths = torch.tensor([0, 1, 2, 1, 2], device=device)
    decoder = model.get_decoder()
    try:
        with _window(model.config, _CHECK_WINDOW):
            want_a = model(input_ids=ids[None, :9], use_cache=False).logits[0, 6:9]
            want_b = model(input_ids=torch.cat((ids[:7], branch_b[:2]))[None], use_cache=False).logits[0, 7:9]
            cache = BufferCache(_text_config(model.config).num_hidden_layers, 11)
            causal = torch.ones(6, 6, dtype=torch.bool, device=device).tril()
            cached_forward(decoder, cache, input_ids=ids[None, :6], position_ids=torch.arange(6, device=device)[None],
                           attention_mask=verification_mask(model, 0, causal, dtype))
            hidden = cached_forward(decoder, cache, input_ids=tree[None], position_ids=(6 + depths)[None],
                                    attention_mask=verification_mask(model, 6, allowed, dtype)).last_hidden_state[0]
            got = output_logits(model, hidden)
    except UnsupportedTarget:
        raise
    except Exception as err:  # a family whose forward does not take position ids, 4D masks or a cache like Llama's
        raise UnsupportedTarget(f"{family}: its forward cannot verify a draft tree ({type(err).__name__}: {err})") \
            from err
    want = torch.cat((want_a, want_b)).float()
    got = got.float()
    scale = want.abs().max().clamp(min=1.0)
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    error = float((got - want).abs().max() / scale)
    if not error <= tolerance:
        raise UnsupportedTarget(f"{family}: tree verification does not reproduce the model's own logits (relative "
                                f"difference {error:.3g}); this family computes its logits or attention in a way "
                                "griffin does not support yet")
    model._griffin_target_checked = True
