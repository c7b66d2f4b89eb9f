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
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .chain import ChainVerifier
from .family import output_logits
from .hub import resolve
from .io import check_integer, read_cached, write_cached
from .kernels import cpu_name
from .kv_cache import BufferCache, cached_forward
from .sampling import SamplingConfig, greedy, sample, warp
from .target import cache_dir, target_fingerprint
from .tree import Tree, chain

log = logging.getLogger(__name__)

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


class DraftLMDrafter:
    """Classic speculative sampling's drafter: the draft LM samples a chain of ``gamma`` tokens with its own KV cache
    (greedy: its argmax chain); the proposal carries the draft's warped distributions q for the p/q chain rule.

    The draft cache holds every emitted token the draft has read. A proposal feeds the tokens it has not read yet
    (the prompt at the first cycle, the last drafted token after a fully accepted chain, and the root), then
    ``gamma - 1`` drafted tokens; :meth:`accept` keeps the accepted ones and drops the rest.
    """

    def __init__(self, draft: DraftLM, gamma: int, capacity: int):
        self.draft = draft
        self.cache: BufferCache | None = None
        self.sampling, self.generator = SamplingConfig(), None
        self.prepare(gamma, capacity)

    def prepare(self, gamma: int, capacity: int) -> None:
        """Set γ and make room for a generation of up to ``capacity`` positions (the cache buffers are reused)."""
        self.depth = self.total_tokens = gamma
        needed = capacity + gamma + 2
        if self.cache is None:
            self.cache = BufferCache(self.draft.num_layers, needed)
        self.cache.prepare(needed)
        self.unread = torch.zeros(0, dtype=torch.long, device=self.draft.device)
        self.read = 0  # cache length after the fed tokens of the last proposal

    def verifier(self, sampling: SamplingConfig, generator: torch.Generator | None) -> ChainVerifier:
        """The p/q chain rule; the drafter samples its own tokens with the same settings and generator."""
        self.sampling, self.generator = sampling, generator
        return ChainVerifier(sampling, generator)

    def start(self, ids: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> None:
        self.cache.crop(0)
        self.unread = ids

    @torch.inference_mode()
    def propose(self, token: torch.Tensor) -> Tree:
        fed = torch.cat((self.unread, token))
        start = self.cache.length
        self.read = start + fed.shape[0]
        logits = self.draft.forward(fed, torch.arange(start, self.read, device=fed.device), self.cache)
        picks, qs = [], []
        for i in range(self.depth):
            if self.sampling.greedy:
                pick = greedy(logits, keepdim=True)  # [1]
            else:
                probs = warp(logits, self.sampling)  # [V']
                pick = sample(probs, self.generator).view(1)
                qs.append(probs)
            picks.append(pick)
            if i < self.depth - 1:
                position = torch.full((1,), self.read + i, dtype=torch.long, device=fed.device)
                logits = self.draft.forward(self.draft.to_target(pick), position, self.cache)
        tokens = self.draft.to_target(torch.cat(picks))  # [γ]
        self.drafted = tokens
        q = None
        if qs:
            q = self.draft.full(torch.stack(qs))  # [γ, V]
            q = torch.cat((q, q.new_zeros(1, q.shape[1])))  # row γ: nothing is sampled after the last token
        return chain(token, tokens, q=q)

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        accepted = tokens.shape[0] - 1  # drafted tokens accepted (the last emitted token is the target's)
        self.cache.crop(self.read + min(accepted, self.depth - 1))
        self.unread = self.drafted[self.depth - 1 :] if accepted == self.depth else self.drafted[:0]


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


CALIBRATION_TOKENS = 64
MAX_GAMMA = 8


def _tuning_key(gen, temperature: float) -> str:
    lm = gen.draft.model
    probe = [p.detach().float().flatten()[:4096].cpu() for p in list(lm.parameters())[:8]]
    parts = [target_fingerprint(gen.target.config), str(gen.backend.lm_head.weight.dtype), str(gen.device),
             cpu_name(), str(torch.get_num_threads()), str(gen.weight_major.max_rows),
             gen.weight_major.describe(), str(lm.num_parameters()),
             str(None if gen.draft.vocab is None else len(gen.draft.vocab)), f"T={temperature}",
             hashlib.sha256(torch.cat(probe).numpy().tobytes()).hexdigest()[:16]]
    return "draft-lm-" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


@torch.inference_mode()
def draft_step_cost(draft: DraftLM, context: int = 256, repeats: int = 9) -> float:
    """Median seconds of one draft step (one token after ``context`` cached ones)."""
    cache = BufferCache(draft.num_layers, context + repeats)
    ids = torch.randint(0, draft.target_width, (context + repeats,), device=draft.device)
    draft.forward(ids[:context], torch.arange(context, device=draft.device), cache)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        draft.forward(ids[context + i : context + i + 1], torch.tensor([context + i], device=draft.device), cache)
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2]


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens per cycle of a chain of γ at per-token acceptance rate α: ``(1 − α^{γ+1}) / (1 − α)``."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def measured_alpha(hist: dict[int, int], gamma: int) -> float:
    """Per-token acceptance rate from a histogram of tokens emitted per cycle with chains of γ: accepted drafted
    tokens / drafted tokens the target judged (a chain is judged up to its first rejection)."""
    accepted = sum((count - 1) * n for count, n in hist.items())
    rejected = sum(n for count, n in hist.items() if count - 1 < gamma)
    return accepted / max(accepted + rejected, 1)


def _checked_gamma(record: dict) -> dict:
    check_integer(record, "gamma", 1)
    return record


def tune_gamma(gen, max_gamma: int = MAX_GAMMA, temperature: float = 0.0, retune: bool = False) -> dict:
    """γ with the best expected speedup ``τ(γ)·t(1) / (γ·draft + t(γ+1))`` on this machine for generations at
    ``temperature``: the target's forward-cost curve t(n), the draft's step cost, and α measured on calibration prompts
    at the temperature's band (:func:`griffin.autotune.temperature_band`; sampled with fixed seeds), cached per machine
    and band; ``retune`` measures again."""
    from .autotune import CALIBRATION, calibration_sampling, forward_cost, temperature_band
    from .generator import GenerationStats

    temperature = temperature_band(temperature)
    path = cache_dir() / "autotune" / f"{_tuning_key(gen, temperature)}.json"
    cached = None if retune else read_cached(path, "tuning record", _checked_gamma, "tuning again")
    if cached is not None:
        return cached
    log.info("tuning the draft LM's chain length for this machine%s (once; cached in %s)",
             f" at T={temperature}" if temperature else "", path)
    costs = forward_cost(gen, list(range(1, max_gamma + 2)))
    step = draft_step_cost(gen.draft)
    saved, gen.gamma = gen.gamma, max_gamma
    hist: dict[int, int] = {}
    try:
        for seed, prompt in enumerate(CALIBRATION):
            stats = GenerationStats()
            ids = gen.encode([{"role": "user", "content": prompt}])
            sampling, generator = calibration_sampling(gen, temperature, seed)
            for _ in gen._steps(ids, CALIBRATION_TOKENS, sampling, gen.eos_ids(None), generator, stats):
                pass
            for count, n in stats.accepted_hist.items():
                hist[count] = hist.get(count, 0) + n
    finally:
        gen.gamma = saved
    # cycles cut short by EOS or the budget emit fewer tokens without a rejection; they are few and count as one
    alpha = measured_alpha(hist, max_gamma)
    table = [{"gamma": g, "tau": expected_tokens(alpha, g),
              "speedup": expected_tokens(alpha, g) * costs[1] / (g * step + costs[g + 1])}
             for g in range(1, max_gamma + 1)]
    best = max(table, key=lambda row: row["speedup"])
    choice = {"gamma": best["gamma"], "temperature": temperature, "alpha": alpha, "expected_tau": best["tau"],
              "expected_speedup_vs_plain_forward": best["speedup"], "draft_step_s": step,
              "forward_cost_s": costs, "candidates": table}
    write_cached(path, choice, "tuning record")
    log.info("draft LM: gamma %d%s (alpha %.2f, expected tau %.2f)", best["gamma"],
             f" at T={temperature}" if temperature else "", alpha, best["tau"])
    return choice
