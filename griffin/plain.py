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
from .kv_cache import BufferCache, RowsCache, cached_forward
from .sampling import SamplingConfig, greedy, sample, sample_token, warp


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


def plain_rows_step(backend, cache: RowsCache, tokens: torch.Tensor, sampling: SamplingConfig,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of :func:`plain_steps` for B rows of different lengths (batched generation, :mod:`griffin.batch`):
    feed ``tokens`` [B], one per row at its own next position -> (the next tokens [B], the fed positions' features
    [B, 1, H] or [B, 1, 3H]). Each row's new entry moves right after its own entries; the
    kernels are those of a B-row pass (:meth:`griffin.backend.TargetBackend.forward_rows`); nothing here waits for the
    device."""
    end = cache.end
    positions = cache.positions(tokens.device)[:, None]  # [B, 1]
    features, logits = backend.forward_rows(tokens[:, None], positions, positions.new_ones(1, 1, 1).bool(), cache)
    cache.compact(torch.full_like(positions, end), [1] * tokens.shape[0], torch.ones_like(tokens))
    logits = logits[:, 0]  # [B, V]
    return (greedy(logits) if sampling.greedy else sample(warp(logits, sampling), generator)), features


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
