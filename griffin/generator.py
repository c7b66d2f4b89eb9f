"""SpecGenerator: speculative generation with a draft head, exactly the target's output.

One cycle: the head drafts a tree (:mod:`griffin.tree`), the target verifies every node in one forward pass through
its public HF forward (4D tree mask, position ids, preallocated KV cache), the longest acceptable path plus one bonus
token is emitted, the KV entries of that path are compacted in place, and the head reads the target's features of the
accepted tokens before drafting again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .chat import check_messages, prompt_ids
from .draft import DraftModel
from .drafters import HeadDrafter
from .family import check_target, output_logits, verification_mask
from .kernels import WeightMajorLinears, default_max_rows
from .kv_cache import BufferCache
from .sampling import SamplingConfig, accept_greedy, accept_sampling, sample_token
from .target import EMBEDDED_TARGET, load_target, resolve_dtype, resolve_target_path
from .tree import Tree

log = logging.getLogger(__name__)
CHECKPOINTS = Path(os.environ.get("GRIFFIN_CHECKPOINTS", Path(__file__).resolve().parent.parent / "checkpoints"))
DEFAULT_HEADS = {EMBEDDED_TARGET: "smollm2-135m-instruct-griffin"}


@dataclass
class GenerationStats:
    new_tokens: int = 0
    cycles: int = 0  # target verification passes (the prefill is not a cycle)
    accepted_hist: dict[int, int] = field(default_factory=dict)  # tokens emitted per cycle (bonus included) -> count
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    prefill_s: float = 0.0

    @property
    def tau(self) -> float:
        """Acceptance length: new tokens per verification pass."""
        return self.new_tokens / self.cycles if self.cycles else float(self.new_tokens)

    @property
    def wall_s(self) -> float:
        return self.draft_s + self.verify_s + self.other_s + self.prefill_s

    def as_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "cycles": self.cycles, "tau": self.tau,
                "accepted_hist": dict(sorted(self.accepted_hist.items())), "draft_s": self.draft_s,
                "verify_s": self.verify_s, "other_s": self.other_s, "prefill_s": self.prefill_s, "wall_s": self.wall_s}


@dataclass
class GenerationResult:
    sequences: torch.Tensor  # [1, prompt + new] like transformers' generate
    stats: GenerationStats
    text: str = ""  # the decoded new tokens


class _Clock:
    """Accumulates wall time into a stats field; synchronises CUDA so the split is honest."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t = time.perf_counter()

    def lap(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        elapsed, self.t = now - self.t, now
        return elapsed


class SpecGenerator:
    def __init__(self, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, draft: DraftModel, depth: int = 5,
                 top_k: int = 8, total_tokens: int = 24, draft_dtype: torch.dtype | None = None,
                 weight_major_rows: int | None = None):
        for name, value in (("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.target, self.tokenizer = target, tokenizer
        self.device = next(target.parameters()).device
        self.draft = draft.to(device=self.device, dtype=draft_dtype or draft.fusion.fc.weight.dtype).eval()
        self.draft.attach(target)
        self.decoder = target.get_decoder()
        self.lm_head = target.get_output_embeddings()
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.num_layers = target.config.get_text_config().num_hidden_layers
        if weight_major_rows is None:
            weight_major_rows = default_max_rows(self.device)
        self.weight_major = WeightMajorLinears(target, weight_major_rows)  # see griffin.kernels
        self.draft_path: Path | None = None  # the folder the head was loaded from, if any

    @classmethod
    def from_pretrained(cls, target: str | os.PathLike | PreTrainedModel = EMBEDDED_TARGET,
                        draft: str | os.PathLike | DraftModel | None = None, *, depth: int = 5, top_k: int = 8,
                        total_tokens: int | str = "auto", dtype: str | torch.dtype | None = None,
                        device: str | torch.device | None = None, draft_dtype: str | torch.dtype | None = "auto",
                        tokenizer: PreTrainedTokenizerBase | None = None,
                        weight_major_rows: int | None = None, retune: bool = False) -> SpecGenerator:
        """``target``: a name (``smollm2-135m-instruct``), a local HF folder or a loaded model (its tokenizer is then
        found locally from the name it was loaded under, or pass ``tokenizer``); ``draft``: a head folder, a
        :class:`DraftModel`, or None for the head shipped for the target. ``total_tokens="auto"`` (the default) picks
        the tree size and depth that maximise the speedup on this machine (measured once in under a minute, then
        cached; ``retune=True`` measures again), overriding ``depth``; pass an int to fix the tree and skip tuning.
        ``draft_dtype="auto"`` runs the head in bf16 where the hardware computes it natively (see
        :func:`fast_draft_dtype`); the head's dtype changes which tokens are drafted, never the output.
        ``weight_major_rows``: verification passes of up to this many tokens compute the target's linear layers
        weight-major (:mod:`griffin.kernels`; default 8 on CPU and 0, off, on GPUs).

        The output is the target's own: greedy tokens equal ``transformers``' ``generate`` on the same model, dtype
        and device (see :mod:`griffin.family` for what "identical" means in bf16 on GPUs); targets whose family
        verification cannot reproduce are refused with the reason (:func:`griffin.family.check_target`)."""
        if total_tokens != "auto" and (isinstance(total_tokens, bool) or not isinstance(total_tokens, int)
                                       or total_tokens < 1):
            raise ValueError(f"total_tokens must be 'auto' or a positive integer, got {total_tokens!r}")
        if isinstance(target, PreTrainedModel):
            model = target.eval()
            tokenizer = tokenizer or local_tokenizer(model)
            target_name = model.config._name_or_path
        else:
            model, loaded_tokenizer = load_target(target, dtype=dtype, device=device)
            tokenizer = tokenizer or loaded_tokenizer
            target_name = str(target)
        check_target(model)
        if draft is None:
            draft = default_head(target_name)
        draft_path = None
        if not isinstance(draft, DraftModel):
            draft_path = Path(draft)
            draft = DraftModel.from_pretrained(draft_path)
        if draft_dtype == "auto":
            draft_dtype = fast_draft_dtype(next(model.parameters()).device)
        gen = cls(model, tokenizer, draft, depth=depth, top_k=top_k, total_tokens=1 if total_tokens == "auto" else
                  total_tokens, draft_dtype=resolve_dtype(draft_dtype), weight_major_rows=weight_major_rows)
        gen.draft_path = draft_path
        if total_tokens == "auto":
            from .autotune import autotune

            gen.depth, gen.top_k, gen.total_tokens = autotune(gen, retune=retune)
        return gen

    # --- inputs --------------------------------------------------------------------------------------------------

    def encode(self, inputs) -> torch.Tensor:
        """Token ids, a string (tokenized as is) or chat messages (chat template applied) -> [P] LongTensor."""
        if isinstance(inputs, str):
            ids = self.tokenizer(inputs, add_special_tokens=True)["input_ids"]
        elif isinstance(inputs, Sequence) and inputs and isinstance(inputs[0], dict):
            ids = prompt_ids(self.tokenizer, list(inputs))
        elif isinstance(inputs, torch.Tensor):
            if inputs.dim() == 2 and inputs.shape[0] != 1:
                raise ValueError(f"batch size {inputs.shape[0]} is not supported yet: pass one prompt")
            if inputs.dim() > 2 or inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool:
                raise ValueError(f"token ids must be a 1D integer tensor, got dtype {inputs.dtype} and shape "
                                 f"{tuple(inputs.shape)}")
            ids = inputs.reshape(-1).tolist()
        elif isinstance(inputs, (Sequence, Iterator)) and not isinstance(inputs, (bytes, dict)):
            ids = list(inputs)
            bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, numbers.Integral)), None)
            if bad is not None:
                raise ValueError(f"token ids must be integers, got {bad!r} ({type(bad).__name__}); pass a string or "
                                 "chat messages to have them tokenized")
        else:
            raise ValueError(f"cannot generate from a {type(inputs).__name__}: pass token ids, a string or chat "
                             "messages")
        if len(ids) == 0:
            raise ValueError("the prompt is empty: pass at least one token")
        vocab = self.target.get_input_embeddings().num_embeddings
        out_of_range = [i for i in ids if not 0 <= int(i) < vocab]
        if out_of_range:
            raise ValueError(f"token ids {out_of_range[:5]} are outside the target's vocabulary [0, {vocab})")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def eos_ids(self, eos_token_id: int | Sequence[int] | None) -> torch.Tensor:
        if eos_token_id is None:
            eos_token_id = self.target.generation_config.eos_token_id
            if eos_token_id is None:
                eos_token_id = self.tokenizer.eos_token_id
        ids = [eos_token_id] if isinstance(eos_token_id, numbers.Integral) else list(eos_token_id or [])
        if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in ids):
            raise ValueError(f"eos_token_id must be an integer or a list of integers, got {eos_token_id!r}")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    # --- target ------------------------------------------------------------------------------------------------------

    def _target_forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                        cache: BufferCache, last_logits_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [q] at positions [q], allowed [q, q] among them (all past entries visible) -> hidden [q, H] and
        logits [q, V] (or [1, V] for the last position only)."""
        q = tokens.shape[0]
        mask = verification_mask(self.target, cache.length, tree_mask, self.lm_head.weight.dtype)
        small = 2 <= q <= self.weight_major.max_rows
        with self.weight_major if small else contextlib.nullcontext():
            hidden = self.decoder(input_ids=tokens[None], position_ids=positions[None], attention_mask=mask,
                                  past_key_values=cache, use_cache=True).last_hidden_state[0]  # [q, H]
            logits = output_logits(self.target, hidden[-1:] if last_logits_only else hidden)
        return hidden, logits

    # --- generation ----------------------------------------------------------------------------------------------

    def make_drafter(self, capacity: int) -> HeadDrafter:
        """A drafter for one generation of up to ``capacity`` positions."""
        return HeadDrafter(self.draft, self.depth, self.top_k, self.total_tokens, capacity)

    @torch.inference_mode()
    def _steps(self, ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig, eos: torch.Tensor,
               generator: torch.Generator | None, stats: GenerationStats, drafter=None,
               trace: list | None = None) -> Iterator[torch.Tensor]:
        """Yield the new tokens of each cycle ([n] LongTensor) until EOS or the token budget.

        ``trace``, if given, receives ``(tree, path)`` of every cycle (used to tune the tree size).
        """
        clock = _Clock(self.device)
        p = ids.shape[0]
        drafter = drafter or self.make_drafter(p + max_new_tokens)
        tree_cap = min(self.total_tokens, self.top_k + (self.depth - 1) * self.top_k**2) + 1
        cache = BufferCache(self.num_layers, p + max_new_tokens + max(tree_cap, drafter.total_tokens + 1))
        positions = torch.arange(p, device=self.device)
        causal = torch.ones(p, p, dtype=torch.bool, device=self.device).tril()
        hidden, logits = self._target_forward(ids, positions, causal, cache, last_logits_only=True)
        token = sample_token(logits[-1], sampling, generator)
        stats.prefill_s += clock.lap()
        stats.new_tokens = 1
        yield token
        if max_new_tokens == 1 or torch.isin(token, eos).any():
            return
        clock.lap()
        drafter.start(ids, hidden, token)
        stats.draft_s += clock.lap()
        n = p  # position of the root: the newest token, not yet seen by the target
        while True:
            tree: Tree = drafter.propose(token)
            stats.draft_s += clock.lap()
            hidden, logits = self._target_forward(tree.tokens, n + tree.depths, tree.ancestors, cache)
            stats.verify_s += clock.lap()
            if sampling.greedy:
                path, bonus = accept_greedy(tree, logits)
            else:
                path, bonus = accept_sampling(tree, logits, sampling, generator)
            emitted = torch.cat((tree.tokens[path[1:]], bonus))
            cache.keep(n, n + path)
            if trace is not None:
                trace.append((tree, path))
            stats.cycles += 1
            stats.accepted_hist[len(emitted)] = stats.accepted_hist.get(len(emitted), 0) + 1
            remaining = max_new_tokens - stats.new_tokens
            hits = torch.isin(emitted, eos).nonzero()
            stop = len(hits) > 0 or len(emitted) >= remaining
            if len(hits):
                emitted = emitted[: int(hits[0]) + 1]
            emitted = emitted[:remaining]
            stats.new_tokens += len(emitted)
            stats.other_s += clock.lap()
            yield emitted
            if stop:
                return
            clock.lap()  # time spent by the consumer is nobody's
            drafter.accept(emitted, hidden[path])
            n += len(emitted)
            token = emitted[-1:]
            stats.draft_s += clock.lap()

    def _prepare(self, inputs, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                 max_length: int | None, seed: int | None):
        check_sampling_arguments(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 max_length=max_length, seed=seed)
        check_target(self.target)
        sampling = SamplingConfig(float(temperature), float(top_p), int(top_k))
        ids = self.encode(inputs)
        if max_length is not None:
            if ids.shape[0] >= max_length:
                raise ValueError(f"the prompt has {ids.shape[0]} tokens, which leaves no room under max_length="
                                 f"{max_length}: raise max_length or shorten the prompt")
            max_new_tokens = min(max_new_tokens, max_length - ids.shape[0])
        window = context_window(self.target)
        if window is not None:
            if ids.shape[0] >= window:
                raise ValueError(f"the prompt has {ids.shape[0]} tokens but the target's context window is {window} "
                                 "tokens: shorten the prompt")
            if ids.shape[0] + max_new_tokens > window:
                log.warning("generation stops at the target's context window (%d tokens): at most %d new tokens",
                            window, window - ids.shape[0])
                max_new_tokens = window - ids.shape[0]
        generator = None
        if not sampling.greedy:
            generator = torch.Generator()
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(int(seed))
        return ids, max_new_tokens, sampling, generator

    def generate(self, inputs, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, eos_token_id: int | Sequence[int] | None = None, max_length: int | None = None,
                 seed: int | None = None, streamer=None, drafter=None) -> GenerationResult:
        """Generate like ``transformers``' ``generate`` (same tokens when greedy, same distribution when sampling).

        ``inputs``: token ids, a string, or chat messages. ``streamer``: any transformers streamer (``put``/``end``).
        ``drafter``: replaces the head's drafting for this call (see :mod:`griffin.drafters`).
        """
        ids, budget, sampling, generator = self._prepare(inputs, max_new_tokens, temperature, top_p, top_k,
                                                         max_length, seed)
        stats = GenerationStats()
        chunks = []
        if streamer is not None:
            streamer.put(ids[None].cpu())
        for chunk in self._steps(ids, budget, sampling, self.eos_ids(eos_token_id), generator, stats, drafter):
            chunks.append(chunk)
            if streamer is not None:
                streamer.put(chunk.cpu())
        if streamer is not None:
            streamer.end()
        new = torch.cat(chunks)
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return GenerationResult(torch.cat((ids, new))[None], stats, text)

    def stream(self, inputs, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               eos_token_id: int | Sequence[int] | None = None, max_length: int | None = None,
               seed: int | None = None, stats: GenerationStats | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are accepted (incomplete UTF-8 characters are held back)."""
        ids, budget, sampling, generator = self._prepare(inputs, max_new_tokens, temperature, top_p, top_k,
                                                         max_length, seed)
        stats = stats if stats is not None else GenerationStats()
        new: list[int] = []
        printed = 0
        for chunk in self._steps(ids, budget, sampling, self.eos_ids(eos_token_id), generator, stats):
            new += chunk.tolist()
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            if len(text) > printed:
                yield text[printed:]
                printed = len(text)

    def chat(self, messages: list[dict[str, str]], **kwargs) -> GenerationResult:
        """Apply the target's chat template to ``messages`` and generate the assistant's reply (``result.text``)."""
        return self.generate(check_messages(messages), **kwargs)


def check_sampling_arguments(max_new_tokens, temperature, top_p, top_k, max_length, seed) -> None:
    """Clear errors for wrongly typed or out-of-range generation arguments (NaN, strings, bools, negatives ...)."""

    def integer(value) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    def real(value) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

    if not integer(max_new_tokens) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if max_length is not None and (not integer(max_length) or max_length <= 0):
        raise ValueError(f"max_length must be a positive integer or None, got {max_length!r}")
    if not real(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if not integer(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if seed is not None and not integer(seed):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")


def context_window(model) -> int | None:
    """The longest sequence the target was built for (``max_position_embeddings``), if its config says."""
    window = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return window if isinstance(window, int) and window > 0 else None


def local_tokenizer(model: PreTrainedModel) -> PreTrainedTokenizerBase:
    """The tokenizer of a loaded target, found on this machine from the name it was loaded under (never downloaded)."""
    name = str(getattr(model.config, "_name_or_path", "") or "")
    hint = "pass tokenizer= (e.g. the one load_target returned)"
    if not name:
        raise ValueError(f"the target model records no name to find its tokenizer by: {hint}")
    try:
        folder = resolve_target_path(name)
    except FileNotFoundError:
        folder = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder or name, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"no tokenizer for {name!r} on this machine ({type(err).__name__}; model hubs are not "
                         f"contacted): {hint}") from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def fast_draft_dtype(device: torch.device) -> torch.dtype | None:
    """bf16 on CUDA and on CPUs with native bf16 matmuls (AVX512-BF16 or AMX), else None (the head's own dtype)."""
    if device.type == "cuda":
        return torch.bfloat16
    native = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private torch.cpu probes, absent in old torch
    if device.type == "cpu" and any(getattr(torch.cpu, probe, lambda: False)() for probe in native):
        return torch.bfloat16
    return None


def default_head(target_name: str) -> Path:
    """The head shipped for a target name (``checkpoints/``), or an error saying what to pass instead."""
    name = DEFAULT_HEADS.get(str(target_name))
    if name and (CHECKPOINTS / name / "config.json").is_file():
        return CHECKPOINTS / name
    raise ValueError(f"no draft head ships for target {str(target_name)!r}: pass draft=<head folder> (train one with "
                     "python -m training.build_features and python -m training.train)")
