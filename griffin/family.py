"""What a target family decides beyond its decoder: the attention mask of a verification pass and the logits step.

Every place that turns target hidden states into logits (verification, plain decoding, training soft labels) calls
:func:`output_logits`, and every verification forward takes its mask from :func:`verification_mask`, so that a family
whose logits or masks differ from Llama's is handled (or refused) in one place.
"""

from __future__ import annotations

import torch


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [.., H] (the decoder's final-norm output) -> logits [.., V] exactly as the model's own forward."""
    return model.get_output_embeddings()(hidden)


def verification_mask(model, past: int, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask of q new tokens after ``past`` cached ones.

    allowed [q, q] bool: which new tokens each new token may see (all cached entries are visible) ->
    [1, 1, q, past + q] with 0 where allowed and the dtype's minimum elsewhere.
    """
    q = allowed.shape[0]
    mask = torch.zeros(1, 1, q, past + q, dtype=dtype, device=allowed.device)
    mask[0, 0, :, past:].masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask
