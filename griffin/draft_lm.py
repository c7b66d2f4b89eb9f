"""Standalone draft language models: any HF causal LM that shares the target's tokenizer.

A draft LM folder is an ordinary ``save_pretrained`` folder (config, safetensors weights, tokenizer), optionally with
``draft_vocab.json``: the target token ids its output layer scores (a *reduced output vocabulary*). Drafting with it
computes logits for those rows only, which makes a step several times cheaper for a small model with a large
vocabulary; the draft's q is 0 on every other token, which speculative sampling handles exactly.

:func:`build_student` makes the default student for a target: the target's own architecture with its embeddings,
its first few decoder layers, its final norm and its output layer (``python -m training.distill`` then distils it).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .family import output_logits
from .hub import resolve
from .kv_cache import cached_forward

VOCAB_FILE = "draft_vocab.json"
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class DraftLM:
    """A causal LM used as a draft: its decoder and the output rows of its (possibly reduced) vocabulary.

    ``vocab`` [V'] (ascending target ids): the rows the draft scores. Without one, a draft whose logits width differs
    from the target's (padding rows) scores the ids both have.
    """

    def __init__(self, model: PreTrainedModel, vocab: torch.Tensor | None = None, target_width: int | None = None):
        self.model = model.eval()
        self.decoder = model.get_decoder()
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.device = next(model.parameters()).device
        head = model.get_output_embeddings()
        width = head.weight.shape[0]
        self.target_width = target_width or width
        if vocab is None and width != self.target_width:
            vocab = torch.arange(min(width, self.target_width))
        if vocab is not None and int(vocab.max()) >= self.target_width:
            raise ValueError(f"the draft vocabulary holds id {int(vocab.max())}, beyond the target's "
                             f"{self.target_width} logits")
        self.vocab = None if vocab is None else vocab.to(self.device)  # [V'] target ids, ascending
        if self.vocab is None:
            self.weight = self.bias = None
        else:  # contiguous copies of the scored rows: one small matmul per step
            self.weight = head.weight.detach()[self.vocab].contiguous()
            self.bias = None if getattr(head, "bias", None) is None else head.bias.detach()[self.vocab].contiguous()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [.., H] (final-norm output) -> logits [.., V'] over the draft vocabulary."""
        if self.vocab is None:
            return output_logits(self.model, hidden)
        return F.linear(hidden, self.weight, self.bias)

    def to_target(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into the draft's logits -> target token ids."""
        return index if self.vocab is None else self.vocab[index]

    def full(self, probs: torch.Tensor) -> torch.Tensor:
        """Probabilities over the draft vocabulary [.., V'] -> over the target's ids [.., target_width], 0 elsewhere."""
        if self.vocab is None:
            return probs
        out = probs.new_zeros(*probs.shape[:-1], self.target_width)
        out[..., self.vocab] = probs
        return out

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """tokens [q] at positions [q] after the cached context (causal) -> logits of the last one [V']."""
        hidden = cached_forward(self.decoder, cache, input_ids=tokens[None],
                                position_ids=positions[None]).last_hidden_state[0, -1]
        return self.logits(hidden)


def vocab_logits(model: PreTrainedModel, hidden: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """hidden [.., H] -> logits [.., V'] of the rows ``vocab`` of the model's output layer (all rows if None), with
    gradients into those rows (training)."""
    if vocab is None:
        return output_logits(model, hidden)
    head = model.get_output_embeddings()
    bias = getattr(head, "bias", None)
    return F.linear(hidden, head.weight[vocab], None if bias is None else bias[vocab])


def load_vocab(folder: str | os.PathLike) -> torch.Tensor | None:
    path = Path(folder) / VOCAB_FILE
    if not path.is_file():
        return None
    ids = json.loads(path.read_text())["ids"]
    return torch.tensor(ids, dtype=torch.long)


def load_draft_lm(folder: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                  revision: str | None = None, token: str | bool | None = None,
                  cache_dir: str | os.PathLike | None = None
                  ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, torch.Tensor | None]:
    """A draft LM folder or Hugging Face Hub id (fetched at ``revision``: :mod:`griffin.hub`) -> (model in eval mode,
    its tokenizer, its reduced vocabulary or None)."""
    folder = resolve(folder, kind="draft LM", revision=revision, token=token, cache_dir=cache_dir)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a model folder: config.json is missing (pass a folder written by "
                                "save_pretrained, e.g. by python -m training.distill)")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32, attn_implementation="sdpa")
    model.to(device or "cpu").eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(folder), load_vocab(folder)


def save_draft_lm(model: PreTrainedModel, folder: str | os.PathLike, vocab: torch.Tensor | None = None,
                  tokenizer: PreTrainedTokenizerBase | None = None, dtype: torch.dtype | None = None) -> None:
    """``save_pretrained`` into ``folder`` file by file via a temporary folder; ``config.json`` is moved last, so a
    folder with a config is complete. Other files in ``folder`` (a training state) are left alone."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".save-", dir=folder))
    try:
        saved = copy.deepcopy(model).to(dtype) if dtype is not None else model
        saved.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if vocab is not None:
            (tmp / VOCAB_FILE).write_text(json.dumps({"ids": vocab.tolist()}))
        elif (folder / VOCAB_FILE).exists():
            (folder / VOCAB_FILE).unlink()
        names = sorted(p.name for p in tmp.iterdir())
        for name in [n for n in names if n != "config.json"] + ["config.json"]:
            os.replace(tmp / name, folder / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_student(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """The target's architecture cut to its first ``num_layers`` decoder layers, with the target's weights for every
    part it keeps (embeddings, those layers, the final norm, the output layer)."""
    total = target.config.get_text_config().num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"the student needs 1..{total} layers (the target has {total}), got {num_layers}")
    config = copy.deepcopy(target.config)
    text = config.get_text_config()
    text.num_hidden_layers = num_layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:num_layers]
    config._name_or_path = ""
    student = type(target)(config)
    state = {k: v for k, v in target.state_dict().items()
             if not (m := _LAYER.search(k)) or int(m.group(1)) < num_layers}
    student.load_state_dict(state, strict=True)
    return student.to(dtype=next(target.parameters()).dtype, device=next(target.parameters()).device)
