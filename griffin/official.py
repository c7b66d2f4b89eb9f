"""The official GRIFFIN, EAGLE-1/2 and EAGLE-3 checkpoint layouts, read and written by explicit key mapping.

Official folders hold a Llama ``config.json`` and ``pytorch_model.bin`` or ``model.safetensors`` with keys ``fc.*``,
``layers.0.*`` and ``embed_tokens.weight``. GRIFFIN nests Token-Guided Fusion under ``fc.`` (``fc.fc``,
``fc.post_attention_layernorm``, ``fc.mlp.input_layernorm``, ``fc.mlp.up_proj``, ``fc.mlp.down_proj``).
The layout has no draft vocabulary: :func:`save_official` writes a reduced-vocabulary head as a full-vocabulary one
(drafts are scored over the whole of the target's lm_head, as official EAGLE-1/2 heads are).

EAGLE-3 heads (the official trainer's, SpecForge's; what vLLM and SGLang serve) have ``"architectures":
["LlamaForCausalLMEagle3"]``, ``draft_vocab_size`` and keys ``midlayer.*`` (vLLM's own copy: ``layers.0.*``), ``fc``
(3H -> H), ``norm``, ``lm_head`` [draft vocabulary, H] and ``d2t`` (draft index -> target id offsets); ``t2d`` and
``embed_tokens`` are optional and shared with the target here. They read the inputs of decoder layers 2, N//2 and N-3
of an N-layer target (both engines' default), so the config names no layers.

This module maps keys and configs only; :meth:`griffin.draft.DraftModel.from_pretrained` builds the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .config import DraftConfig, default_feature_layers
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
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
_MIDLAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")
EAGLE3_KEYS = {"fc.weight": "fusion.fc.weight", "fc.bias": "fusion.fc.bias", "norm.weight": "norm.weight",
               "lm_head.weight": "lm_head.weight", **{f"midlayer.{k}": f"layer.{k}" for k in _MIDLAYER}}


def is_official_config(raw: dict[str, Any]) -> bool:
    return "arch" not in raw


def is_eagle3_config(raw: dict[str, Any]) -> bool:
    """An EAGLE-3 checkpoint's config (vLLM accepts the name with Eagle3 at either end)."""
    names = raw.get("architectures") or []
    return any(isinstance(n, str) and (n.startswith("Eagle3") or n.endswith("Eagle3")) for n in names)


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


def read_official(folder: Path, raw_config: dict[str, Any],
                  target_config=None) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """An official checkpoint folder -> this package's config and state dict (keys renamed, fp32)."""
    if is_eagle3_config(raw_config):
        return read_eagle3(folder, raw_config, target_config)
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
    return config, {k: v.float() for k, v in state.items()}


def read_eagle3(folder: Path, raw: dict[str, Any], target_config=None) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """An EAGLE-3 checkpoint -> an ``eagle3`` config and state dict. ``d2t`` becomes the draft vocabulary's target
    ids; without it the draft vocabulary is the whole target vocabulary."""
    source = folder / "config.json"
    state = read_official_state(folder)
    state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    unknown = sorted(k for k in state if k not in EAGLE3_KEYS and k not in {"d2t", "t2d", *IGNORED_KEYS})
    if unknown:
        raise ValueError(f"unexpected keys for an EAGLE-3 checkpoint in {folder}: {unknown}")
    hidden = raw.get("hidden_size")
    if raw.get("target_hidden_size") not in (None, hidden):
        raise ValueError(f"{source}: target_hidden_size {raw['target_hidden_size']} differs from hidden_size {hidden};"
                         " a head narrower than its target is not supported here")
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{source}: num_hidden_layers is {raw['num_hidden_layers']}; EAGLE-3 heads have one layer")
    vocab = raw.get("vocab_size")
    draft_vocab = raw.get("draft_vocab_size") or vocab
    ids = None
    if "d2t" in state:
        ids = state.pop("d2t").long() + torch.arange(state["lm_head.weight"].shape[0])
        if ids.shape[0] != draft_vocab or (ids[1:] <= ids[:-1]).any() or ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"{folder}: d2t does not map {draft_vocab} draft tokens to increasing target ids below "
                             f"{vocab}")
    state.pop("t2d", None)
    layers = _eagle3_layers(raw, target_config)
    try:
        config = DraftConfig.from_target(raw, arch="eagle3", fc_bias="fc.bias" in state, context_vocab=False,
                                         draft_vocab_size=0 if draft_vocab == vocab and ids is None else draft_vocab,
                                         feature_layers=layers)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{source} (an EAGLE-3 config): {err}") from None
    config.target.update(name=raw.get("_name_or_path", ""), num_hidden_layers=None)
    if target_config is not None:
        config.target = DraftConfig.from_target(target_config, arch="eagle3", context_vocab=False).target
    state = {EAGLE3_KEYS[k]: v.float() for k, v in state.items() if k in EAGLE3_KEYS}
    if config.draft_vocab_size:
        state["draft_vocab"] = ids if ids is not None else torch.arange(draft_vocab)
    return config, state


def _eagle3_layers(raw: dict[str, Any], target_config) -> list[int] | None:
    """The target layers an EAGLE-3 checkpoint reads: vLLM's top-level ``eagle_aux_hidden_state_layer_ids`` (layer
    inputs) if given, else EAGLE-3's default for the target (None until the head is attached, when unknown)."""
    given = raw.get("eagle_aux_hidden_state_layer_ids")
    if given is not None:
        return list(given)
    if target_config is None:
        return None
    get = target_config.get if isinstance(target_config, dict) else (lambda k: getattr(target_config, k, None))
    return default_feature_layers(get("num_hidden_layers"))


def official_state(head, embed: torch.Tensor) -> dict[str, torch.Tensor]:
    """This package's head -> the official key names, plus the target's input embedding [V, H] as
    ``embed_tokens.weight``. The draft vocabulary (if any) is dropped: the official layout has none."""
    if head.config.parts_ablated:
        raise ValueError(f"this head was built without {' and '.join(head.config.parts_ablated)}, which the official "
                         "GRIFFIN layout always has: an ablation head is served by this package only")
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


def eagle3_config(cfg: DraftConfig) -> dict[str, Any]:
    """The ``config.json`` vLLM's and SGLang's EAGLE-3 loaders read (``LlamaForCausalLMEagle3``, one layer)."""
    return {**official_config(cfg), "architectures": [EAGLE3_ARCHITECTURE], "bias": False,
            "draft_vocab_size": cfg.output_vocab_size, "target_hidden_size": cfg.hidden_size}


def eagle3_state(head) -> dict[str, torch.Tensor]:
    """An ``eagle3`` head -> the EAGLE-3 keys, with ``d2t`` [draft vocabulary] int64 offsets and ``t2d`` [V] bool.
    Refuses what a serving engine would run differently: griffin3 (Token-Guided Fusion and dual heads have no
    EAGLE-3 keys), a bias on ``fc`` (vLLM builds none) and target layers other than EAGLE-3's default (vLLM and
    SGLang read ``eagle_aux_hidden_state_layer_ids`` one layer apart)."""
    cfg = head.config
    if cfg.arch != "eagle3":
        raise ValueError(f"a {cfg.arch} head cannot be written in the EAGLE-3 layout: its Token-Guided Fusion and dual"
                         " heads change the forward, and vLLM / SGLang would run it without them (wrong drafts); serve"
                         " it with this package, or export an eagle3 head" if cfg.arch == "griffin3" else
                         f"the EAGLE-3 layout holds eagle3 heads, not {cfg.arch} (use --format official)")
    if cfg.fc_bias:
        raise ValueError("this head's fc has a bias, which vLLM's EAGLE-3 loader does not build")
    layers = cfg.target.get("num_hidden_layers")
    if layers is None or cfg.feature_layers != default_feature_layers(layers):
        raise ValueError(f"this head reads target layers {cfg.feature_layers}, not EAGLE-3's default for its target "
                         f"({layers} layers): vLLM and SGLang disagree on how to name other layers")
    inverse = {ours: theirs for theirs, ours in EAGLE3_KEYS.items()}
    state = {inverse[k]: v for k, v in head.state_dict().items() if k in inverse}
    ids = head.static_vocab().cpu().long()
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {**state, "d2t": ids - torch.arange(ids.shape[0]), "t2d": t2d}


def save_eagle3(head, folder: Path, dtype: torch.dtype = torch.float16) -> None:
    """Write an ``eagle3`` head in the EAGLE-3 layout (atomically): ``config.json`` + ``model.safetensors``."""
    state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in eagle3_state(head).items()}
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    atomic_write_json(folder / "config.json", {**eagle3_config(head.config), "torch_dtype": str(dtype)[6:]})
