"""The official GRIFFIN and EAGLE-1/2 checkpoint layouts, read and written by explicit key mapping.

Official folders hold a Llama ``config.json`` and ``pytorch_model.bin`` or ``model.safetensors`` with keys ``fc.*``,
``layers.0.*`` and ``embed_tokens.weight``. GRIFFIN nests Token-Guided Fusion under ``fc.`` (``fc.fc``,
``fc.post_attention_layernorm``, ``fc.mlp.input_layernorm``, ``fc.mlp.up_proj``, ``fc.mlp.down_proj``).
The layout has no draft vocabulary: :func:`save_official` writes a reduced-vocabulary head as a full-vocabulary one
(drafts are scored over the whole of the target's lm_head, as official EAGLE-1/2 heads are).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .config import DraftConfig
from .io import atomic_write, atomic_write_json, load_safetensors

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


def official_state(head, embed: torch.Tensor) -> dict[str, torch.Tensor]:
    """This package's head -> the official key names, plus the target's input embedding [V, H] as
    ``embed_tokens.weight``. The draft vocabulary (if any) is dropped: the official layout has none."""
    inverse = {ours: theirs for theirs, ours in (GRIFFIN_KEYS if head.config.is_griffin else EAGLE_KEYS).items()}
    state = {k: v for k, v in head.state_dict().items() if k != "draft_vocab"}
    unmapped = sorted(set(state) - set(inverse))
    if unmapped:
        raise ValueError(f"no official name for {unmapped}: this head cannot be written in the official layout")
    if tuple(embed.shape) != (head.config.vocab_size, head.config.hidden_size):
        raise ValueError(f"the embedding has shape {tuple(embed.shape)}, but the head was built for a target with "
                         f"vocabulary {head.config.vocab_size} and hidden size {head.config.hidden_size}")
    return {**{inverse[k]: v for k, v in state.items()}, "embed_tokens.weight": embed}


def official_config(cfg: DraftConfig) -> dict[str, Any]:
    """The Llama ``config.json`` of an official one-layer head (RoPE as ``rope_theta`` and ``rope_scaling``)."""
    rope = dict(cfg.rope_parameters)
    theta = rope.pop("rope_theta", 10000.0)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": cfg.target.get("name", ""),
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": 1, "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": theta,
        "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
        "max_position_embeddings": cfg.max_position_embeddings, "attention_bias": cfg.attention_bias,
        "bias": cfg.fc_bias, "hidden_act": "silu", "tie_word_embeddings": False,
    }


def save_official(head, folder: Path, embed: torch.Tensor, dtype: torch.dtype = torch.float16) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the official layout (atomically)."""
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in official_state(head, embed).items()}
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    atomic_write_json(folder / "config.json", {**official_config(head.config), "torch_dtype": str(dtype)[6:]})
