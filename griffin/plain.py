"""Plain autoregressive decoding with the same target forward and KV cache as the speculative engine.

The reference point for speedups that isolates speculation from framework overhead (transformers' ``generate`` is the
other reference). Each decode step computes the target's linear layers with the fastest one-row kernel measured for
this machine, model and dtype (:func:`griffin.kernels.choose_kernels`), so that plain decoding gets the same kernel
choice that verification gets. :func:`plain_steps` is the loop itself: :func:`plain_generate` runs it, and so does the
speculative generator wherever it drafts no tree (:func:`griffin.decode.decode`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .family import output_logits
from .kernels import WeightMajorLinears, choose_kernels
from .kv_cache import BufferCache, cached_forward
from .sampling import SamplingConfig, sample_token


def plain_steps(model, cache: BufferCache, token: torch.Tensor, sampling: SamplingConfig,
                generator: torch.Generator | None,
                layers: list[int] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Plain decoding after the cached context, without end: feed ``token`` [1] at the cache's next position, yield
    (the next token [1], the target's hidden state of the fed position [1, H], or with ``layers`` the hidden states
    entering those layers [1, 3H], what a fused-feature head reads), then feed that token. The caller stops it (EOS,
    budget) and holds the kernels (``with WeightMajorLinears(...)``); nothing here waits for the device."""
    decoder = model.get_decoder()
    position = torch.tensor([cache.length], device=token.device)
    while True:
        out = cached_forward(decoder, cache, input_ids=token[None], position_ids=position[None],
                             output_hidden_states=layers is not None)
        hidden = out.last_hidden_state[0]  # [1, H]
        token = sample_token(output_logits(model, hidden[-1]), sampling, generator)
        yield token, (hidden if layers is None else torch.cat([out.hidden_states[i][0] for i in layers], dim=-1))
        position = position + 1


@torch.inference_mode()
def plain_generate(target, ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig, eos: torch.Tensor,
                   generator: torch.Generator | None = None, one_row: str | None = None) -> torch.Tensor:
    """ids [P] -> the new tokens [n] (one target forward per token). ``one_row``: the kernel of the one-token steps
    (:data:`griffin.kernels.ONE_ROW_KERNELS`; default: the fastest measured for the target on this machine)."""
    decoder = target.get_decoder()
    kernels = WeightMajorLinears(target, 0, one_row or choose_kernels(target).one_row)
    cache = BufferCache(target.config.get_text_config().num_hidden_layers, ids.shape[0] + max_new_tokens)
    positions = torch.arange(ids.shape[0], device=ids.device)
    hidden = cached_forward(decoder, cache, input_ids=ids[None],
                            position_ids=positions[None]).last_hidden_state  # the prompt: F.linear
    token = sample_token(output_logits(target, hidden[0, -1]), sampling, generator)
    new = [token]
    with kernels:
        steps = plain_steps(target, cache, token, sampling, generator)
        while len(new) < max_new_tokens and not torch.isin(token, eos).any():
            token, _ = next(steps)
            new.append(token)
    return torch.cat(new)
