"""Loading the official GRIFFIN and EAGLE-1/2 checkpoint layouts by explicit key mapping.

Official folders hold a Llama ``config.json`` and ``pytorch_model.bin`` or ``model.safetensors`` with keys ``fc.*``,
``layers.0.*`` and ``embed_tokens.weight``. GRIFFIN nests Token-Guided Fusion under ``fc.`` (``fc.fc``,
``fc.post_attention_layernorm``, ``fc.mlp.input_layernorm``, ``fc.mlp.up_proj``, ``fc.mlp.down_proj``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .config import DraftConfig
from .io import load_safetensors

_LAYER = {
    "layers.0.self_attn.q_proj.weight": "layer.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight": "layer.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight": "layer.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight": "layer.self_attn.o_proj.weight",
    "layers.0.self_attn.q_proj.bias": "layer.self_attn.q_proj.bias",
    "layers.0.self_attn.k_proj.bias": "layer.self_attn.k_proj.bias",
    "layers.0.self_attn.v_proj.bias": "layer.self_attn.v_proj.bias",
    "layers.0.mlp.gate_proj.weight": "layer.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight": "layer.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight": "layer.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight": "layer.post_attention_layernorm.weight",
}
EAGLE_KEYS = {"fc.weight": "fusion.fc.weight", "fc.bias": "fusion.fc.bias", **_LAYER}
GRIFFIN_KEYS = {
    "fc.fc.weight": "fusion.fc.weight",
    "fc.fc.bias": "fusion.fc.bias",
    "fc.post_attention_layernorm.weight": "fusion.norm_fused.weight",
    "fc.mlp.input_layernorm.weight": "fusion.norm.weight",
    "fc.mlp.up_proj.weight": "fusion.up.weight",
    "fc.mlp.down_proj.weight": "fusion.down.weight",
    **_LAYER,
}
# Stored by the official code but shared with the target at run time here.
IGNORED_KEYS = {"embed_tokens.weight"}


def is_official_config(raw: dict[str, Any]) -> bool:
    return "arch" not in raw


def read_official_state(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        return load_safetensors(folder / "model.safetensors")
    if (folder / "pytorch_model.bin").is_file():
        try:
            state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises several kinds (UnpicklingError, RuntimeError, EOFError) for bad files
            raise ValueError(f"{folder / 'pytorch_model.bin'} is truncated, corrupted or not a plain state dict "
                             f"({type(err).__name__}: {' '.join(str(err).split())[:200]})") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{folder / 'pytorch_model.bin'} is not a state dict of tensors")
        return state
    raise FileNotFoundError(f"{folder} holds neither model.safetensors nor pytorch_model.bin")


def map_official_state(state: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
    """Official keys -> this package's keys. Returns the detected arch and the renamed state dict."""
    arch = "griffin" if "fc.fc.weight" in state else "eagle"
    table = GRIFFIN_KEYS if arch == "griffin" else EAGLE_KEYS
    unknown = sorted(k for k in state if k not in table and k not in IGNORED_KEYS)
    if unknown:
        raise ValueError(f"unexpected keys for an official {arch} checkpoint: {unknown}")
    return arch, {table[k]: v for k, v in state.items() if k in table}


def load_official(folder: Path, raw_config: dict[str, Any], target_config=None):
    from .draft import DraftModel, check_state_dict

    arch, state = map_official_state(read_official_state(folder))
    overrides: dict[str, Any] = {"fc_bias": "fusion.fc.bias" in state}
    if arch == "griffin":
        overrides["tgf_intermediate_size"] = state["fusion.up.weight"].shape[0]
    try:
        if target_config is not None:
            config = DraftConfig.from_target(target_config, arch=arch, **overrides)
            config.intermediate_size = raw_config.get("intermediate_size", config.intermediate_size)
        else:
            config = DraftConfig.from_target(raw_config, arch=arch, **overrides)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{folder / 'config.json'} (an official {arch} config): {err}") from None
    model = DraftModel(config)
    check_state_dict(model, state, str(folder))
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model
