"""Draft heads: EAGLE-1/2 (``arch="eagle"``), GRIFFIN (``arch="griffin"``, Token-Guided Fusion + dual heads), and
their EAGLE-3-generation forms ``eagle3`` and ``griffin3`` (fused target layers, own norm and lm_head).

At draft position ``t`` the head reads the token ``x_{t+1}`` (through the target's frozen embedding) and the feature
``f_t`` that predicted it, and returns two features: ``predict`` (scored by the lm_head for the logits of ``x_{t+2}``)
and ``regress`` (fed back as the feature of position ``t+1`` while drafting). EAGLE returns one feature for both.
The target's embedding and lm_head are attached at run time (:meth:`DraftModel.attach`), never stored.

The fused archs read, from the target, its hidden states entering three decoder layers (3H), which ``fc`` reduces to
H; a fed-back ``regress`` feature (H) bypasses ``fc``. Their decoder layer attends over
``cat(input_layernorm(e), hidden_norm(h))`` (2H) with ``h`` as the residual, and their ``predict`` is already normed
by the head's final ``norm``, ready for its own trained lm_head over the draft vocabulary.

Shapes: B batch, T new positions, S keys (cache + new), H hidden, nh/nkv heads, D head dim, V (draft) vocabulary.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from .config import DraftConfig, default_feature_layers
from .family import logits_transform
from .hub import resolve
from .io import atomic_write, load_safetensors, read_json
from .target import target_fingerprint

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"


class DraftOutput(NamedTuple):
    predict: torch.Tensor  # [B, T, H] -> lm_head -> logits of the next token
    regress: torch.Tensor  # [B, T, H] -> the next position's input feature while drafting
    key: torch.Tensor  # [B, nkv, T, D] keys of the new positions (after RoPE)
    value: torch.Tensor  # [B, nkv, T, D]


class EagleFusion(nn.Module):
    """``h = fc(cat(e, f))``."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)

    def forward(self, e: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat((e, f), dim=-1))


class TokenGuidedFusion(EagleFusion):
    """GRIFFIN's TGF: ``u = fc(cat(e, f))``; ``v = u + down(SiLU(up(cat(n(norm_fused(u)), n(e)))))``.

    ``n`` is one RMSNorm shared by both inputs, exactly as in the official checkpoints; the second input is the token
    embedding (the paper's ablation shows it matters).
    """

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        self.norm_fused = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.up = nn.Linear(2 * cfg.hidden_size, cfg.tgf_intermediate_size, bias=False)
        self.down = nn.Linear(cfg.tgf_intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, e: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        u = super().forward(e, f)
        z = self.up(torch.cat((self.norm(self.norm_fused(u)), self.norm(e)), dim=-1))
        return u + self.down(F.silu(z))


class FusedFeatures(nn.Module):
    """EAGLE-3's input: ``h = fc(f)`` for target features of three layers (3H), ``h = f`` for a fed-back feature (H);
    the layer receives ``cat(e, h)`` [.., 2H] (it normalises the two halves itself). ``griffin3`` refines ``h`` with
    Token-Guided Fusion on the token embedding first (``tgf``)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.fc = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.tgf = TokenGuidedFusion(cfg) if cfg.tgf else None

    def forward(self, e: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        h = self.fc(f) if f.shape[-1] == self.fc.in_features else f
        if self.tgf is not None:
            h = self.tgf(e, h)
        return torch.cat((e, h), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width = 2 * cfg.hidden_size if cfg.fused else cfg.hidden_size  # fused archs: cat(norm(e), norm(h))
        self.q_proj = nn.Linear(width, self.nh * self.d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(width, self.nkv * self.d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(width, self.nkv * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.d, cfg.hidden_size, bias=False)

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [B, T, H] -> q [B, nh, T, D], k and v [B, nkv, T, D], with RoPE applied to q and k."""
        b, t, _ = h.shape
        q = self.q_proj(h).view(b, t, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.nkv, self.d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, nh, T, D], k/v [B, nkv, S, D], mask bool [B or 1, 1, T, S] (True = attend; None: causal, S = T)
        -> [B, T, H]."""
        return self.output(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                          enable_gqa=self.nh != self.nkv))

    def output(self, heads: torch.Tensor) -> torch.Tensor:
        """Attention output per head [B, nh, T, D] -> [B, T, H]."""
        return self.o_proj(heads.transpose(1, 2).reshape(heads.shape[0], heads.shape[2], self.nh * self.d))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, out: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer without its input RMSNorm (EAGLE-1/2, GRIFFIN) or with two (the fused archs: one for the
    token embedding, one for the feature). GRIFFIN's MLP outputs 2H onto a duplicated residual."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        if cfg.fused:
            self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.fused = cfg.fused
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        out = 2 * cfg.hidden_size if cfg.dual_heads else cfg.hidden_size
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, out)
        self.dual = cfg.dual_heads

    def split(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused input [.., H] or [.., 2H] -> (attention input, residual)."""
        if not self.fused:
            return h, h
        e, f = h.chunk(2, dim=-1)
        return torch.cat((self.input_layernorm(e), self.hidden_norm(f)), dim=-1), f

    def finish(self, r: torch.Tensor) -> torch.Tensor:
        """r = h + attention(h), [B, T, H] -> [B, T, H] (EAGLE) or [B, T, 2H] (GRIFFIN)."""
        residual = torch.cat((r, r), dim=-1) if self.dual else r
        return residual + self.mlp(self.post_attention_layernorm(r))


class DraftModel(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        if config.fused:
            self.fusion = FusedFeatures(config)
        else:
            self.fusion = TokenGuidedFusion(config) if config.tgf else EagleFusion(config)
        self.layer = DecoderLayer(config)
        self.rotary = LlamaRotaryEmbedding(config.to_llama_config())
        # the fused archs' own final norm and lm_head over the draft vocabulary (the others share the target's)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps) if config.fused else None
        self.lm_head = nn.Linear(config.hidden_size, config.output_vocab_size, bias=False) if config.fused else None
        if config.draft_vocab_size:
            # draft token index -> target token id
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.draft_vocab = None
        self._shared: dict[str, torch.Tensor | nn.Module | None] = {}
        self.logits_transform = logits_transform(config)  # identity until attached
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    # --- target-shared parts -----------------------------------------------------------------------------------------

    def attach(self, target: nn.Module) -> DraftModel:
        """Share the target's embedding and lm_head (frozen). Raises if the head was built for another target."""
        cfg, tcfg = self.config, target.config
        hidden, vocab = tcfg.hidden_size, target.get_input_embeddings().num_embeddings
        if (hidden, vocab) != (cfg.hidden_size, cfg.vocab_size):
            name = cfg.target.get("name") or "another target"
            raise ValueError(
                f"this draft head was built for {name} (hidden size {cfg.hidden_size}, vocabulary {cfg.vocab_size}) "
                f"but the target has hidden size {hidden} and vocabulary {vocab}: use a head trained for this target "
                "(python -m training.build_features / training.train) or the matching target"
            )
        layers = tcfg.get_text_config().num_hidden_layers if hasattr(tcfg, "get_text_config") else None
        if cfg.fused and cfg.feature_layers is None and layers is not None:  # an EAGLE-3 checkpoint: the default
            cfg.feature_layers = default_feature_layers(layers)
            cfg.target["num_hidden_layers"] = layers
        if cfg.fused and layers is not None and max(cfg.feature_layers) >= layers:
            raise ValueError(f"this {cfg.arch} head reads target layers {cfg.feature_layers} but the target has "
                             f"{layers} layers: use a head trained for this target")
        expected = cfg.target.get("fingerprint")
        if expected and expected != target_fingerprint(tcfg):
            log.warning("draft head was trained for target %s with another architecture fingerprint; acceptance may "
                        "be poor (outputs stay exact)", cfg.target.get("name"))
        self._shared = {"embed": target.get_input_embeddings(), "lm_head": target.get_output_embeddings()}
        self.logits_transform = logits_transform(tcfg)  # the target's own logits step (griffin.family)
        return self

    @property
    def attached(self) -> bool:
        return bool(self._shared)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self._shared:
            raise RuntimeError("attach the draft head to its target first: draft.attach(target_model)")
        return self._shared["embed"](input_ids).to(self.fusion.fc.weight.dtype)

    def lm_weight_full(self) -> torch.Tensor:
        """The target's lm_head weight [V, H] (frozen, shared)."""
        return self._shared["lm_head"].weight.detach()

    def static_vocab(self) -> torch.Tensor:
        """Target ids of the head's fixed draft vocabulary [V_d] (all ids for a full-vocabulary head)."""
        if self.draft_vocab is not None:
            return self.draft_vocab
        return torch.arange(self.config.vocab_size, device=self.fusion.fc.weight.device)

    def logits(self, predict: torch.Tensor) -> torch.Tensor:
        """predict [.., H] -> logits over the static draft vocabulary [.., V_d] (drafting uses DraftVocab)."""
        if self.lm_head is not None:
            return self.lm_head(predict)
        weight = self.lm_weight_full()[self.static_vocab().to(predict.device)]
        return self.logits_transform(F.linear(predict, weight.to(predict.dtype)))

    # --- forward -----------------------------------------------------------------------------------------------------

    def fuse(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """tokens [B, T], features [B, T, H] (fused archs: [B, T, 3H] from the target or [B, T, H] fed back) -> fused
        input of the decoder layer [B, T, H] (fused archs: [B, T, 2H], token embedding and feature)."""
        return self.fusion(self.embed(input_ids), features.to(self.fusion.fc.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache=None,
        past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> DraftOutput:
        """One decoder pass over T new positions.

        Keys are (in order) ``past_kv`` or the cache's stored keys, then the T new ones. ``mask`` is bool
        [B or 1, 1, T, S] with True = attend; None means causal over the new positions with full access to the past.
        """
        return self.forward_fused(self.fuse(input_ids, features), position_ids, mask, cache, past_kv)

    def forward_fused(self, h, position_ids, mask=None, cache=None, past_kv=None, queries=None,
                      attention: Callable[..., torch.Tensor] | None = None) -> DraftOutput:
        """``queries`` [B, Tq]: the positions (indices into T) whose outputs are wanted; the MLP runs at those only
        (training's first pass needs every key but not every output). ``attention(q, k_new, v_new)`` -> [B, nh, T, D]
        replaces the attention over past and new keys (training's draft chains, whose keys differ per query)."""
        x, h = self.layer.split(h)
        cos, sin = self.rotary(h, position_ids)
        q, k_new, v_new = self.layer.self_attn.project(x, cos, sin)
        if attention is not None:
            r = h + self.layer.self_attn.output(attention(q, k_new, v_new))
            return self.outputs(r, k_new, v_new, queries)
        if cache is not None:
            k, v = cache.append(k_new, v_new)
        elif past_kv is not None:
            k, v = torch.cat((past_kv[0], k_new), dim=2), torch.cat((past_kv[1], v_new), dim=2)
        else:
            k, v = k_new, v_new
        t, s = q.shape[2], k.shape[2]
        if mask is None and s != t:  # causal over the new positions with the past in front (s == t: SDPA's own)
            mask = torch.ones(t, s, dtype=torch.bool, device=h.device).tril(s - t)[None, None]
        return self.outputs(h + self.layer.self_attn.attend(q, k, v, mask), k_new, v_new, queries)

    def outputs(self, r: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                queries: torch.Tensor | None) -> DraftOutput:
        """The layer after its attention (r = h + attention, [B, T, H]) at the ``queries`` positions, and the heads'
        features."""
        if queries is not None:
            r = r.gather(1, queries[..., None].expand(-1, -1, r.shape[2]))
        out = self.layer.finish(r)
        predict, regress = out.chunk(2, dim=-1) if self.config.dual_heads else (out, out)
        if self.norm is not None:  # the fused archs: predict normed for the own lm_head, regress fed back pre-norm
            predict = self.norm(predict)
        return DraftOutput(predict, regress, k_new, v_new)

    # --- persistence -------------------------------------------------------------------------------------------------

    def num_parameters(self) -> int:
        """Trainable parameters of the head (the target's embedding and lm_head are shared, not counted)."""
        return sum(p.numel() for p in self.parameters())

    def save_pretrained(self, folder: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Write ``config.json`` and ``model.safetensors`` (atomically; the target's parts are not stored)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {}
        for k, v in self.state_dict().items():
            v = v.detach().contiguous().cpu()
            state[k] = v.to(dtype) if dtype is not None and v.is_floating_point() else v
        atomic_write(folder / WEIGHTS_NAME, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
        self.config.save(folder)

    @classmethod
    def from_pretrained(
        cls,
        folder: str | os.PathLike,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        target_config=None,
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> DraftModel:
        """Load a head saved by :meth:`save_pretrained`, or an official GRIFFIN / EAGLE / EAGLE-3 checkpoint (EAGLE-3
        heads of the official trainer and SpecForge included), from a folder or a Hugging Face Hub id (``org/name``,
        fetched at ``revision`` with ``token`` into ``cache_dir``: :mod:`.hub`).

        Official checkpoints carry no record of their target; pass ``target_config`` to record it (an EAGLE-3 head
        learns which target layers it reads when attached, if not from it).
        """
        from .official import is_official_config, read_official

        folder = resolve(folder, kind="draft head", revision=revision, token=token, cache_dir=cache_dir)
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{folder} is not a draft head folder: config.json is missing")
        raw = read_json(config_path, "head config")
        if not isinstance(raw, dict):
            raise ValueError(f"{config_path} holds a JSON {type(raw).__name__}, not a head config object")
        if is_official_config(raw):
            config, state = read_official(folder, raw, target_config)
            source = str(folder)
        else:
            weights = folder / WEIGHTS_NAME
            if not weights.is_file():
                raise FileNotFoundError(f"{weights} is missing")
            try:
                config = DraftConfig.from_dict(raw)
            except (ValueError, TypeError) as err:
                raise ValueError(f"{config_path}: {err}") from None
            state, source = load_safetensors(weights), str(weights)
        model = cls(config)
        check_state_dict(model, state, source)
        model.load_state_dict(state)
        model.requires_grad_(False).eval()
        # Heads are often stored in fp16, which CPUs compute slowly: default to fp32.
        return model.to(device=device, dtype=dtype or torch.float32)


def check_state_dict(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Fail with one message listing every missing, unexpected or mis-shaped key."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k])}"
              for k in sorted(set(expected) & set(state)) if tuple(state[k].shape) != tuple(expected[k])]
    if missing or unexpected or shapes:
        parts = [f"missing keys {missing}" if missing else "", f"unexpected keys {unexpected}" if unexpected else "",
                 f"shape mismatches {shapes}" if shapes else ""]
        raise ValueError(f"cannot load {source}: " + "; ".join(p for p in parts if p))
