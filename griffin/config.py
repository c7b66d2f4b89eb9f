"""Configuration of a draft head (GRIFFIN or EAGLE), stored as ``config.json`` beside its weights."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import LlamaConfig

from .constants import FUSED_ARCHS
from .constants import HEAD_ARCHS as ARCHS

POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                 "head_dim", "tgf_intermediate_size", "max_position_embeddings", "num_hidden_layers")
OPTIONAL = ("head_dim", "tgf_intermediate_size")  # derived when None


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers of an N-layer target: the inputs of decoder layers 2, N//2 and N-3."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


@dataclass
class DraftConfig:
    """A Llama-style one-layer config plus the fields that describe the head and the target it was trained for.

    ``intermediate_size`` is the decoder layer's MLP width; ``tgf_intermediate_size`` the width of Token-Guided
    Fusion's expansion (GRIFFIN only). ``tgf`` and ``dual_heads`` are GRIFFIN's two draft-model parts, both on by
    default for the griffin archs and off for the EAGLE ones; turning one off gives the ablation heads that say which
    part pays. ``draft_vocab_size`` > 0 restricts the head's logits to that many target tokens
    (ids stored with the weights), which makes drafting cheaper without affecting losslessness; ``context_vocab``
    adds the tokens of the current context to that set (the head is trained that way too).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    arch: str = "griffin"
    tgf: bool | None = None  # Token-Guided Fusion (None: the arch's default)
    dual_heads: bool | None = None  # separate predict and regress features (None: the arch's default)
    head_dim: int | None = None
    tgf_intermediate_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    fc_bias: bool = True
    draft_vocab_size: int = 0
    context_vocab: bool = True  # with a reduced vocabulary, context tokens become proposable too (griffin.vocab)
    num_hidden_layers: int = 1
    # eagle3 / griffin3: the target layers whose inputs are fused (None: EAGLE-3's default, set when attached)
    feature_layers: list[int] | None = None
    target: dict[str, Any] = field(default_factory=dict)
    model_type: str = "griffin_draft"

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        for name in POSITIVE_INTS:
            value = getattr(self, name)
            if (value is not None or name not in OPTIONAL) and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"field {name!r} must be a positive integer, got {value!r}")
        if not isinstance(self.draft_vocab_size, int) or isinstance(self.draft_vocab_size, bool):
            raise ValueError(f"field 'draft_vocab_size' must be an integer, got {self.draft_vocab_size!r}")
        if isinstance(self.rms_norm_eps, bool) or not isinstance(self.rms_norm_eps, (int, float)) or not (
                self.rms_norm_eps > 0):
            raise ValueError(f"field 'rms_norm_eps' must be a positive number, got {self.rms_norm_eps!r}")
        if not isinstance(self.rope_parameters, dict) or "rope_theta" not in self.rope_parameters:
            raise ValueError(f"field 'rope_parameters' must be a dict with 'rope_theta', got {self.rope_parameters!r}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}: set head_dim")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for part in ("tgf", "dual_heads"):
            value = getattr(self, part)
            if value is None:
                setattr(self, part, self.is_griffin)
            elif not isinstance(value, bool):
                raise ValueError(f"field {part!r} must be true, false or null, got {value!r}")
            elif value and not self.is_griffin:
                raise ValueError(f"field {part!r} is a part of the griffin archs, not of {self.arch!r}: use "
                                 f"arch={'griffin3' if self.fused else 'griffin'}")
        if self.is_griffin and not (self.tgf or self.dual_heads):
            raise ValueError(f"a {self.arch} head without Token-Guided Fusion and dual heads is an "
                             f"{'eagle3' if self.fused else 'eagle'} head: use that arch")
        if self.tgf and self.tgf_intermediate_size is None:
            self.tgf_intermediate_size = self.intermediate_size
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [0, {self.vocab_size}] (0 = full vocabulary)")
        if self.fused:
            self._check_fused()
        elif self.feature_layers is not None:
            raise ValueError(f"feature_layers is for the fused archs {FUSED_ARCHS}, not {self.arch!r}")

    def _check_fused(self) -> None:
        layers = self.feature_layers
        if layers is not None:
            if not isinstance(layers, (list, tuple)) or len(layers) != 3 or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
                raise ValueError(f"field 'feature_layers' of a {self.arch} head must be three layer indices >= 0, "
                                 f"got {layers!r}")
            self.feature_layers = list(layers)
        if self.context_vocab:
            raise ValueError(f"a {self.arch} head scores its draft vocabulary with its own lm_head: context_vocab "
                             "must be false")

    @property
    def is_griffin(self) -> bool:
        """A GRIFFIN arch (``griffin``, and ``griffin3`` on the EAGLE-3 base): Token-Guided Fusion and dual heads,
        unless ``tgf`` or ``dual_heads`` turns one off."""
        return self.arch in ("griffin", "griffin3")

    @property
    def griffin_parts(self) -> dict[str, bool]:
        """GRIFFIN's draft-model parts -> whether this head has each."""
        return {"Token-Guided Fusion": self.tgf, "dual heads": self.dual_heads}

    @property
    def parts_ablated(self) -> list[str]:
        """The GRIFFIN parts this griffin-arch head was built without (empty for a full head and the EAGLE archs)."""
        return [name for name, on in self.griffin_parts.items() if not on] if self.is_griffin else []

    @property
    def fused(self) -> bool:
        """Reads fused features of three target layers and scores with its own norm and lm_head (EAGLE-3 base)."""
        return self.arch in FUSED_ARCHS

    @property
    def feature_size(self) -> int:
        """Width of the target features the head reads: 3H for the fused archs, H otherwise."""
        return 3 * self.hidden_size if self.fused else self.hidden_size

    @property
    def output_vocab_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_target(cls, target_config, arch: str = "griffin", **overrides: Any) -> DraftConfig:
        """Derive the head's shape from the target's config (a HF config object or a dict)."""
        from .target import target_fingerprint

        get = (lambda k, d=None: target_config.get(k, d)) if isinstance(target_config, dict) else (
            lambda k, d=None: getattr(target_config, k, d))
        rope = get("rope_parameters")
        if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type (Gemma-3): the global one
            rope = rope.get("full_attention") or next(iter(rope.values()))
        if not rope:  # configs from before transformers 5 keep rope_theta and rope_scaling apart
            rope = dict(get("rope_scaling") or {"rope_type": "default"})
            rope.setdefault("rope_type", rope.pop("type", "default"))
            rope["rope_theta"] = get("rope_theta", 10000.0)
        if "rope_theta" not in rope and isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma-3)
            rope = rope["full_attention"]  # the head's one layer attends over the whole context
        fields = dict(
            arch=arch,
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_attention_heads=get("num_attention_heads"),
            num_key_value_heads=get("num_key_value_heads") or get("num_attention_heads"),
            head_dim=get("head_dim"),
            vocab_size=get("vocab_size"),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            rope_parameters=dict(rope),
            max_position_embeddings=get("max_position_embeddings", 4096),
            attention_bias=bool(get("attention_bias", False)),
            target={
                "name": get("name_or_path") or get("_name_or_path") or "",
                "fingerprint": target_fingerprint(target_config) if not isinstance(target_config, dict) else "",
                "hidden_size": get("hidden_size"),
                "vocab_size": get("vocab_size"),
            },
        )
        if arch in FUSED_ARCHS:
            layers = get("num_hidden_layers")
            fields.update(feature_layers=default_feature_layers(layers), fc_bias=False, context_vocab=False)
            fields["target"]["num_hidden_layers"] = layers
        fields.update(overrides)
        return cls(**fields)

    def to_llama_config(self) -> LlamaConfig:
        """The equivalent one-layer LlamaConfig (used for the rotary embedding)."""
        return LlamaConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, num_hidden_layers=1, vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters), max_position_embeddings=self.max_position_embeddings,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftConfig:
        if not isinstance(data, dict):
            raise ValueError(f"a draft config is a JSON object, got {type(data).__name__}")
        fields = dataclasses.fields(cls)
        unknown = sorted(set(data) - {f.name for f in fields})
        if unknown:
            raise ValueError(f"unknown fields in draft config: {unknown}")
        required = [f.name for f in fields if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ValueError(f"missing fields {missing} in draft config")
        return cls(**data)

    def save(self, folder: str | os.PathLike) -> None:
        from .io import atomic_write_text

        atomic_write_text(Path(folder) / "config.json", json.dumps(self.to_dict(), indent=2) + "\n")
