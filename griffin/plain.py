"""Plain autoregressive decoding with the same target forward and KV cache as the speculative engine.

The reference point for speedups that isolates speculation from framework overhead (transformers' ``generate`` is the
other reference).
"""

from __future__ import annotations

import torch

from .family import output_logits
from .kv_cache import BufferCache
from .sampling import SamplingConfig, sample_token


@torch.inference_mode()
def plain_generate(target, ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig, eos: torch.Tensor,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """ids [P] -> the new tokens [n] (one target forward per token)."""
    decoder = target.get_decoder()
    cache = BufferCache(target.config.get_text_config().num_hidden_layers, ids.shape[0] + max_new_tokens)
    positions = torch.arange(ids.shape[0], device=ids.device)
    tokens = ids
    new = []
    for _ in range(max_new_tokens):
        hidden = decoder(input_ids=tokens[None], position_ids=positions[None], past_key_values=cache,
                         use_cache=True).last_hidden_state
        tokens = sample_token(output_logits(target, hidden[0, -1]), sampling, generator)
        new.append(tokens)
        if torch.isin(tokens, eos).any():
            break
        positions = positions[-1:] + 1
    return torch.cat(new)
