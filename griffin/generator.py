"""SpecGenerator: speculative generation with a draft head, exactly the target's output.

The generator holds the target's backend, the head and the tree's settings, and runs the one decode loop
(:func:`griffin.decode.decode`; the cycle and its invariants: ``docs/design.md``), with the tree tuned per temperature
band (:mod:`griffin.autotune`) and adapted per request (:mod:`griffin.adapt`).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .adapt import ADAPT_RATIO, ADAPT_ROWS, PROBE_EXCESS, Shape, ShapePolicy, needed_ratio, probe_excess
from .autotune import autotune_batch, batch_tuning_record, pass_cost, shapes, temperature_band, tune_gamma, tuned_choice
from .backend import TargetBackend
from .batch import batch_drafter, decode_rows
from .chat_template import check_messages, prompt_ids
from .compat import check_compatible
from .decode import GenerationStats, decode
from .draft import DraftModel
from .draft_lm import DraftLM, load_draft_lm
from .drafters import DraftLMDrafter, HeadDrafter, NoDraft, PromptLookup
from .family import check_target, window_crossed
from .hub import hub_id, resolve
from .kv_cache import BufferCache
from .sampling import SamplingConfig
from .target import EMBEDDED_TARGET, load_target, resolve_device, resolve_dtype, resolve_target_path
from .turns import one_thread_at_a_time
from .verify import Drafter, Verifier

__all__ = ["BatchResult", "GenerationResult", "GenerationStats", "SpecGenerator"]

log = logging.getLogger(__name__)
CHECKPOINTS = Path(os.environ.get("GRIFFIN_CHECKPOINTS", Path(__file__).resolve().parent.parent / "checkpoints"))
DEFAULT_HEADS = {EMBEDDED_TARGET: "smollm2-135m-instruct-griffin"}


@dataclass
class GenerationResult:
    sequences: torch.Tensor  # [1, prompt + new] like transformers' generate
    stats: GenerationStats
    text: str = ""  # the decoded new tokens


@dataclass
class BatchResult:
    """A batch's output (``generate`` given several prompts, :mod:`griffin.batch`)."""

    sequences: torch.Tensor  # [B, longest prompt + most new tokens]: prompts left-padded, new tokens, then padding
    tokens: list[list[int]]  # each row's new tokens
    texts: list[str]  # each row's decoded new tokens
    stats: GenerationStats  # over all rows; tau: new tokens per row per target pass


class SpecGenerator:
    """Speculative generation with a draft head (EAGLE-2 trees) or a standalone draft LM (``draft`` a
    :class:`griffin.draft_lm.DraftLM`: chains of ``gamma`` tokens, classic speculative sampling).

    Threads: a generator may be shared by threads, whose generations take turns. :meth:`generate` (and :meth:`chat`)
    holds the target model for the whole call and :meth:`stream` from its first piece until it is exhausted or
    closed; a generation of another thread on the same target (through this generator or another one built on the
    same loaded model) waits meanwhile, and each output is the one it would have been alone. One thread may
    interleave several streams. To generate in parallel, load a target model (and a generator) per thread.
    """

    def __init__(self, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, draft: DraftModel | DraftLM,
                 depth: int = 5, top_k: int = 8, total_tokens: int = 24, draft_dtype: torch.dtype | None = None,
                 weight_major_rows: int | None = None, timing: bool = False, gamma: int = 4,
                 compile: str | dict | None = None, lookup: int = 0):
        for name, value, least in (("depth", depth, 1), ("top_k", top_k, 1), ("total_tokens", total_tokens, 0),
                                   ("gamma", gamma, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        check_lookup(lookup)
        self.target, self.tokenizer = target, tokenizer
        self.backend = TargetBackend(target, weight_major_rows, compile=compile)
        self.device = self.backend.device
        self.gamma = gamma  # chain length of a draft LM
        if isinstance(draft, DraftLM):
            self.draft = draft
        else:
            self.draft = draft.to(device=self.device, dtype=draft_dtype or draft.fusion.fc.weight.dtype).eval()
            self.draft.attach(target)
            self.backend.feature_layers = draft.config.feature_layers  # fused-feature heads read three layers
        self.decoder, self.lm_head = self.backend.decoder, self.backend.lm_head
        self.num_layers = self.backend.num_layers
        self.weight_major = self.backend.weight_major
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.lookup = lookup  # tokens of the prompt-lookup chain added to each head tree (0: none)
        # proposals keep static sizes (padding verified, nothing read back) on a GPU and when compiled; on the CPU,
        # where a read costs no sync, the lookup chain is cut to its real tokens (:class:`PromptLookup`)
        self.static_shapes = self.device.type != "cpu" or compile is not None
        self.lookup_ngrams: tuple[int, ...] | None = None  # the chain's n-gram sizes (None: PromptLookup's default)
        self.timing = timing  # split draft / verify / other time in GenerationStats (synchronises the device)
        self.draft_path: Path | None = None  # the folder the head was loaded from, if any
        self._drafter: HeadDrafter | DraftLMDrafter | None = None
        self._busy = False  # a generation is using the shared KV buffer and drafter
        self.autotuned = False  # the tree (or gamma) follows each generation's temperature band (see tune_for)
        self.tunings: dict[float, dict] = {}  # temperature band -> the tuning record of the tree in use there
        self._retune = False  # measure each band again once (retune=True) instead of reading this machine's record
        self._retuned: set[float] = set()  # the bands measured again so far
        self._band: float | None = None  # the temperature band the current tree (or gamma) was tuned for
        self.adapt = True  # with a tuned tree, resize it per request from the tuner's shapes (griffin.adapt)
        self._shapes: list[Shape] = []  # the tuner's shapes for the current band (none for a fixed tree)
        self._batch_trees: dict[tuple[float, int], tuple[int, int]] = {}  # (band, batch size) -> (depth, total)
        # (band, batch size) -> the shapes to adapt among and the forward-cost curve they are priced on
        self._batch_shapes: dict[tuple[float, int], tuple[list[Shape], dict[int, float] | None]] = {}

    @classmethod
    def from_pretrained(cls, target: str | os.PathLike | PreTrainedModel = EMBEDDED_TARGET,
                        draft: str | os.PathLike | DraftModel | None = None, *, depth: int = 5, top_k: int = 8,
                        total_tokens: int | str = "auto", dtype: str | torch.dtype | None = None,
                        device: str | torch.device | None = None, draft_dtype: str | torch.dtype | None = "auto",
                        tokenizer: PreTrainedTokenizerBase | None = None,
                        weight_major_rows: int | None = None, timing: bool = False,
                        compile: str | dict | None = None,
                        draft_model: str | os.PathLike | PreTrainedModel | None = None,
                        gamma: int | str = "auto", retune: bool = False, lookup: int = 0,
                        revision: str | None = None, draft_revision: str | None = None,
                        token: str | bool | None = None, cache_dir: str | os.PathLike | None = None,
                        draft_tokenizer: PreTrainedTokenizerBase | None = None, adapt: bool = True) -> SpecGenerator:
        """``target``: a name (``smollm2-135m-instruct``), a local HF folder or a loaded model (moved to ``device``
        and cast to ``dtype`` when given; its tokenizer is then found locally from the name it was loaded under, or
        pass ``tokenizer``); ``draft``: a head folder, a :class:`DraftModel`, or None for the head shipped for the
        target. ``total_tokens="auto"`` (the default) picks the tree size and depth that maximise the speedup on this
        machine (measured once in under a minute, then cached; ``retune=True`` measures again), overriding
        ``depth``; pass an int to fix the tree and skip tuning (0: no tree, the plain loop's own steps and kernels,
        :func:`griffin.plain.plain_steps`, or prompt lookup alone with ``lookup``; the tuner picks the plain loop
        where no tree beats it by more than the measured noise). The tree is tuned per temperature band (sampling
        accepts less than greedy decoding): for greedy decoding when loaded, and for a
        sampled band the first time a generation asks for it (:meth:`tune_for`).
        ``draft_dtype="auto"`` runs the head in bf16 where the hardware computes it natively (see
        :func:`fast_draft_dtype`); the head's dtype changes which tokens are drafted, never the output.
        ``weight_major_rows``: verification passes of up to this many tokens compute the target's linear layers with
        the kernel measured fastest on this machine for their row count (:mod:`griffin.kernels`; default: up to the
        largest count where one beats ``F.linear`` on CPU, 0, off, on GPUs). ``timing``: record the
        draft / verify / other split of each generation's time (synchronises the device; off by default).
        ``compile``: run verification passes with static shapes through ``torch.compile`` (a mode such as
        ``"reduce-overhead"``, which uses CUDA graphs, or a dict of its options; off by default).

        ``draft_model``: a standalone draft LM instead of a head (classic speculative sampling): a folder (e.g. from
        ``python -m training.distill``) or a loaded HF causal LM that uses the target's tokenizer (checked first:
        :func:`griffin.compat.check_compatible`). It drafts chains of ``gamma`` tokens; ``gamma="auto"`` (the default)
        picks the length with the best expected speedup from measured costs and acceptance (cached and tuned per
        temperature band, like the tree size). ``draft_tokenizer``: the loaded draft model's tokenizer (like
        transformers' ``assistant_tokenizer=``; default: the one saved in the folder it was loaded from).

        ``lookup``: add to every head tree a chain of this many tokens copied from the context (prompt lookup,
        :class:`griffin.drafters.PromptLookup`), which the target verifies in the same pass; 0 (the default) adds
        none. With ``total_tokens="auto"`` the tree is tuned with the chain in it (its cost and what it accepts).

        ``target``, ``draft`` and ``draft_model`` may be Hugging Face Hub ids (``org/name``, or ``org/name@revision``),
        fetched into the Hub cache on first use and read from it afterwards, also offline (:mod:`griffin.hub`): the
        target at ``revision``, the head or draft LM at ``draft_revision``, both with ``token`` and ``cache_dir``
        (default: the Hub's own settings, ``HF_TOKEN``, ``HF_HUB_CACHE``). A local folder of the same spelling wins.
        A head may be in this package's layout or the official EAGLE / GRIFFIN one.
        ``adapt`` (with ``total_tokens="auto"``): each generation resizes the tree from the tuner's shapes as it goes,
        down to the plain loop when its running acceptance does not pay for a tree, and back up when it recovers
        (:mod:`griffin.adapt`; per request, nothing cached); False keeps the tuned tree throughout.

        The output is the target's own: greedy tokens equal ``transformers``' ``generate`` on the same model, dtype
        and device (see :mod:`griffin.family` for what "identical" means in bf16 on GPUs); targets whose family
        verification cannot reproduce are refused with the reason (:func:`griffin.family.check_target`)."""
        if total_tokens != "auto" and (isinstance(total_tokens, bool) or not isinstance(total_tokens, int)
                                       or total_tokens < 0):
            raise ValueError(f"total_tokens must be 'auto' or a non-negative integer, got {total_tokens!r}")
        check_lookup(lookup)
        if lookup and draft_model is not None:
            raise ValueError("lookup adds a chain to a head's tree: it does not combine with draft_model")
        if draft_tokenizer is not None and not isinstance(draft_model, PreTrainedModel):
            raise ValueError("draft_tokenizer goes with a loaded draft_model (a folder brings its own tokenizer)")
        hub = dict(revision=draft_revision, token=token, cache_dir=cache_dir)  # Hub ids: fetched before the target
        if draft_model is not None and not isinstance(draft_model, PreTrainedModel):
            draft_model = resolve(draft_model, kind="draft LM", **hub)
        elif draft is not None and not isinstance(draft, DraftModel):
            draft = resolve(draft, kind="draft head", **hub)
        if isinstance(target, PreTrainedModel):
            model = target.eval()
            if device is not None or dtype is not None:  # as for a name: the target runs where and how asked
                model.to(device=None if device is None else resolve_device(device), dtype=resolve_dtype(dtype))
            tokenizer = tokenizer or local_tokenizer(model)
            target_name = model.config._name_or_path
        else:
            model, loaded_tokenizer = load_target(target, dtype=dtype, device=device, revision=revision, token=token,
                                                  cache_dir=cache_dir)
            tokenizer = tokenizer or loaded_tokenizer
            target_name = str(target)
        check_target(model)
        if draft_model is not None:
            return cls._with_draft_lm(model, tokenizer, draft_model, gamma, draft_dtype, weight_major_rows, timing,
                                      compile, retune, draft_tokenizer)
        if draft is None:
            draft = default_head(target_name)
        draft_path = None
        if not isinstance(draft, DraftModel):
            draft_path = Path(draft)
            draft = DraftModel.from_pretrained(draft_path)
        if draft_dtype == "auto":
            draft_dtype = fast_draft_dtype(next(model.parameters()).device)
        gen = cls(model, tokenizer, draft, depth=depth, top_k=top_k, total_tokens=1 if total_tokens == "auto" else
                  total_tokens, draft_dtype=resolve_dtype(draft_dtype), weight_major_rows=weight_major_rows,
                  timing=timing, compile=compile)
        gen.draft_path = draft_path
        gen.lookup, gen.adapt = lookup, adapt
        if total_tokens == "auto":
            gen.follow_temperature(retune)
        return gen

    @classmethod
    def _with_draft_lm(cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                       draft_model: str | os.PathLike | PreTrainedModel, gamma: int | str,
                       draft_dtype: str | torch.dtype | None, weight_major_rows: int | None,
                       timing: bool, compile: str | dict | None, retune: bool,
                       draft_tokenizer: PreTrainedTokenizerBase | None) -> SpecGenerator:
        device = next(model.parameters()).device
        dtype = None if draft_dtype == "auto" else resolve_dtype(draft_dtype)
        vocab, draft_path = None, None
        if isinstance(draft_model, PreTrainedModel):
            lm = draft_model.to(device=device, dtype=dtype).eval()
            source = lm.config._name_or_path or ""
            if draft_tokenizer is None:
                if not (Path(source) / "tokenizer_config.json").is_file() and hub_id(source) is None:
                    raise ValueError("the draft model was not loaded from a folder with its tokenizer, which the "
                                     "compatibility check needs: pass draft_tokenizer=<its tokenizer>")
                draft_tokenizer = AutoTokenizer.from_pretrained(source)
        else:
            draft_path = Path(draft_model)
            lm, draft_tokenizer, vocab = load_draft_lm(draft_path, dtype=dtype, device=device)
        check_compatible(tokenizer, draft_tokenizer, model, lm)
        if gamma != "auto" and (not isinstance(gamma, int) or gamma < 1):
            raise ValueError(f"gamma must be a positive integer or 'auto', got {gamma!r}")
        draft = DraftLM(lm, vocab, target_width=model.get_output_embeddings().weight.shape[0])
        gen = cls(model, tokenizer, draft, weight_major_rows=weight_major_rows, timing=timing, compile=compile,
                  gamma=1 if gamma == "auto" else gamma)
        gen.draft_path = draft_path
        if gamma == "auto":
            gen.follow_temperature(retune)
        return gen

    # --- tuning --------------------------------------------------------------------------------------------------

    def follow_temperature(self, retune: bool = False) -> None:
        """From now on choose the tree (a draft LM's gamma) per generation from what this machine measured for its
        temperature band (:mod:`griffin.autotune`); tune the greedy one now. ``retune``: measure every band again, once.
        Setting ``depth``/``total_tokens``/``gamma`` by hand afterwards holds until a generation changes the band."""
        self.autotuned, self._band, self._retune, self._retuned = True, None, retune, set()
        self._batch_trees, self._batch_shapes = {}, {}
        self.tune_for(0.0)

    @one_thread_at_a_time  # its measuring generations run the target too
    def tune_for(self, temperature: float) -> None:
        """Use the tree (gamma) tuned for ``temperature``'s band, measuring it first (under a minute, once per machine)
        if it was never tuned here, and the shapes adaptation may switch between. A no-op unless
        :meth:`follow_temperature` is on (``total_tokens="auto"``)."""
        band = temperature_band(temperature)
        if not self.autotuned or band == self._band:
            return
        retune = self._retune and band not in self._retuned
        if isinstance(self.draft, DraftLM):
            self.gamma = tune_gamma(self, temperature=band, retune=retune)["gamma"]
        else:
            choice = self.tunings[band] = tuned_choice(self, retune=retune, temperature=band)
            self.depth, self.top_k, self.total_tokens = choice["depth"], choice["top_k"], choice["total_tokens"]
            self._shapes = shapes(choice, self.lookup)
        self._retuned.add(band)
        self._band = band

    def tuning(self, temperature: float) -> dict | None:
        """The tuning record of the tree this generator uses at ``temperature``'s band, as it took it (None: a fixed
        tree, or a band not tuned yet)."""
        return self.tunings.get(temperature_band(temperature)) if self.autotuned else None

    # --- inputs --------------------------------------------------------------------------------------------------

    def encode(self, inputs) -> torch.Tensor:
        """Token ids, a string (tokenized as is) or chat messages (chat template applied) -> [P] LongTensor."""
        if isinstance(inputs, str):
            ids = self.tokenizer(inputs, add_special_tokens=True)["input_ids"]
        elif isinstance(inputs, Sequence) and inputs and isinstance(inputs[0], dict):
            ids = prompt_ids(self.tokenizer, list(inputs))
        elif isinstance(inputs, torch.Tensor):
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
            raise ValueError("the prompt is empty: pass at least one token (a batch: a non-empty list of prompts)")
        vocab = self.target.get_input_embeddings().num_embeddings
        out_of_range = [i for i in ids if not 0 <= int(i) < vocab]
        if out_of_range:
            raise ValueError(f"token ids {out_of_range[:5]} are outside the target's vocabulary [0, {vocab})")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def encode_batch(self, inputs, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor] | None:
        """A batch of prompts -> each row's token ids [P_b]; None when ``inputs`` is one prompt. A batch is a list of
        strings, token lists or chats (mixed as you like), or a [B, P] tensor of token ids, left-padded with an
        ``attention_mask`` [B, P] (1: token, 0: padding) as transformers takes them."""
        if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and (inputs.shape[0] > 1
                                                                       or attention_mask is not None):
            if attention_mask is None:
                return [self.encode(row) for row in inputs]
            mask = torch.as_tensor(attention_mask)
            if mask.shape != inputs.shape:
                raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but the token ids {tuple(inputs.shape)}"
                                 ": pass the mask the tokenizer returned with them")
            if not ((mask == 0) | (mask == 1)).all() or (mask[:, 1:] < mask[:, :-1]).any():
                raise ValueError("attention_mask must be 0 (padding) then 1 (tokens) in each row: pad on the left, "
                                 "e.g. tokenizer(..., padding=True, padding_side='left')")
            return [self.encode(row[m.bool()]) for row, m in zip(inputs, mask.to(inputs.device), strict=True)]
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a [B, P] tensor of token ids: pass the tensor the tokenizer "
                             "returned with it, or a list of prompts without a mask")
        if isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], (str, list, tuple, torch.Tensor)):
            return [self.encode(row) for row in inputs]
        return None

    def eos_ids(self, eos_token_id: int | Sequence[int] | None) -> torch.Tensor:
        if eos_token_id is None:
            eos_token_id = self.target.generation_config.eos_token_id
            if eos_token_id is None:
                eos_token_id = self.tokenizer.eos_token_id
        ids = [eos_token_id] if isinstance(eos_token_id, numbers.Integral) else list(eos_token_id or [])
        if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in ids):
            raise ValueError(f"eos_token_id must be an integer or a list of integers, got {eos_token_id!r}")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    # --- generation ----------------------------------------------------------------------------------------------

    @property
    def plain(self) -> bool:
        """Whether generations draft nothing (no tree, no chain; depth 0: the tuner chose the plain loop over the
        chain too): they run the plain loop (:func:`griffin.plain.plain_steps`)."""
        return (not isinstance(self.draft, DraftLM) and self.total_tokens == 0
                and (self.lookup == 0 or self.depth == 0))

    def make_drafter(self, capacity: int, shared: bool = True) -> HeadDrafter | PromptLookup | DraftLMDrafter:
        """The drafter, prepared for one generation of up to ``capacity`` positions (a head's wrapped in
        :class:`PromptLookup` when ``lookup`` is set). ``shared``: the one built once and reused (its draft vocabulary
        and KV cache survive across generations), else a new one."""
        if isinstance(self.draft, DraftLM):
            if not shared:
                return DraftLMDrafter(self.draft, self.gamma, capacity)
            if self._drafter is None or self._drafter.draft is not self.draft:
                self._drafter = DraftLMDrafter(self.draft, self.gamma, capacity)
            else:
                self._drafter.prepare(self.gamma, capacity)
            return self._drafter
        depth, total = self.depth, self.total_tokens
        if self.adapting:  # room for the largest shape adaptation may take
            depth, total = max(s.depth for s in self._shapes), max(s.total_tokens for s in self._shapes)
        if total == 0:
            head = NoDraft()
        elif not shared:
            head = HeadDrafter(self.draft, depth, self.top_k, total, capacity)
        elif self._drafter is None or self._drafter.draft is not self.draft:
            head = self._drafter = HeadDrafter(self.draft, depth, self.top_k, total, capacity)
        else:
            head = self._drafter
            head.prepare(depth, self.top_k, total, capacity)
        if not self.lookup:
            return head
        return PromptLookup(head, self.lookup, capacity, self.lookup_ngrams, trim=not self.static_shapes)

    @property
    def adapting(self) -> bool:
        """Whether generations adapt the tree: a tuned head tree (its shapes measured) with ``adapt`` on; where the
        tuner kept no tree, only while its best tree would pay on a request accepting
        :data:`griffin.adapt.ADAPT_RATIO` times what the tuner expects (:func:`griffin.adapt.needed_ratio`)."""
        if not (self.adapt and self._shapes) or isinstance(self.draft, DraftLM):
            return False
        return not self.plain or needed_ratio(self._shapes) <= ADAPT_RATIO

    def _steps(self, ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig, eos: torch.Tensor,
               generator: torch.Generator | None, stats: GenerationStats, drafter: Drafter | None = None,
               trace: list | None = None, verifier: Verifier | None = None) -> Iterator[torch.Tensor]:
        """Yield the new tokens of each cycle (a CPU LongTensor [n]) until EOS or the token budget, through
        :func:`griffin.decode.decode` with this generator's KV buffer and drafter (``drafter``: another one for this
        call). ``trace``, if given, receives ``(tree, path)`` of every tree cycle."""
        # the KV buffer and the head's drafter are reused across generations, unless another one is still running
        shared = not self._busy
        self._busy = True
        try:
            p = ids.shape[0]
            policy = None
            if drafter is None and (self.adapting or not self.plain):
                drafter = self.make_drafter(p + max_new_tokens, shared)
                if self.adapting:
                    policy = ShapePolicy(self._shapes, plain_first=self.plain)
            max_len = p + max_new_tokens + (drafter.total_tokens if drafter is not None else 0) + 1
            cache = self.backend.prepare(max_len) if shared else BufferCache(self.num_layers, max_len)
            yield from decode(self.backend, drafter, ids, max_new_tokens, sampling, eos, generator, stats, cache,
                              verifier=verifier, policy=policy, timing=self.timing, trace=trace)
        finally:
            if shared:
                self._busy = False

    def _prepare(self, inputs, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                 max_length: int | None, seed: int | None):
        check_sampling_arguments(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 max_length=max_length, seed=seed)
        check_target(self.target)
        sampling = SamplingConfig(float(temperature), float(top_p), int(top_k))
        ids = self.encode(inputs)
        max_new_tokens = token_budget(self.target, ids.shape[0], max_new_tokens, max_length)
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=self.device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(int(seed))
        self.tune_for(sampling.temperature)
        return ids, max_new_tokens, sampling, generator

    @one_thread_at_a_time
    def generate(self, inputs, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, eos_token_id: int | Sequence[int] | None = None, max_length: int | None = None,
                 seed: int | None = None, streamer=None, drafter=None,
                 attention_mask: torch.Tensor | None = None) -> GenerationResult | BatchResult:
        """Generate like ``transformers``' ``generate`` (same tokens when greedy, same distribution when sampling).

        ``inputs``: token ids, a string, or chat messages; or a batch (-> :class:`BatchResult`): a list of those, or
        a [B, P] tensor left-padded with its ``attention_mask``; every row gets exactly its own output
        (:meth:`generate_batch`). ``streamer``: any transformers streamer (``put``/``end``). ``drafter``: replaces
        the head's drafting for this call (see :mod:`griffin.drafters`).
        """
        rows = self.encode_batch(inputs, attention_mask)
        if rows is not None:
            if streamer is not None or drafter is not None:
                raise ValueError("streamer and drafter take one prompt: generate a batch without them")
            return self._generate_rows(rows, max_new_tokens, temperature, top_p, top_k, eos_token_id, max_length,
                                       seed)
        ids, budget, sampling, generator = self._prepare(inputs, max_new_tokens, temperature, top_p, top_k,
                                                         max_length, seed)
        stats = GenerationStats()
        chunks = []
        if streamer is not None:
            streamer.put(ids[None].cpu())
        for chunk in self._steps(ids, budget, sampling, self.eos_ids(eos_token_id), generator, stats, drafter):
            chunks.append(chunk)
            if streamer is not None:
                streamer.put(chunk)
        if streamer is not None:
            streamer.end()
        new = torch.cat(chunks)
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return GenerationResult(torch.cat((ids, new.to(ids.device)))[None], stats, text)

    def _generate_rows(self, rows: list[torch.Tensor], max_new_tokens: int, temperature: float, top_p: float,
                       top_k: int, eos_token_id: int | Sequence[int] | None, max_length: int | None,
                       seed: int | None) -> BatchResult:
        """A batch through :func:`griffin.batch.decode_rows` (a batch of one: the one-prompt loop)."""
        check_sampling_arguments(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 max_length=max_length, seed=seed)
        check_target(self.target)
        sampling = SamplingConfig(float(temperature), float(top_p), int(top_k))
        budgets = [token_budget(self.target, ids.shape[0], max_new_tokens, max_length) for ids in rows]
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=self.device)
            generator.seed() if seed is None else generator.manual_seed(int(seed))
        eos = self.eos_ids(eos_token_id)
        stats = GenerationStats()
        self.tune_for(sampling.temperature)
        if len(rows) == 1:
            tokens = [torch.cat(list(self._steps(rows[0], budgets[0], sampling, eos, generator, stats))).tolist()]
        else:
            if isinstance(self.draft, DraftLM):
                raise ValueError("batched generation drafts with a head: generate one prompt at a time with a draft "
                                 "LM, or load the generator with a head")
            depth, total = self.batch_tree(len(rows), sampling.temperature)
            policy = self.batch_policy(len(rows), sampling.temperature)
            if policy is not None:  # the drafter is made for the largest shape adaptation may take
                depth = max(depth, *(s.depth for s in policy.trees))
                total = max(total, *(s.total_tokens for s in policy.trees))
            longest = max(ids.shape[0] + n for ids, n in zip(rows, budgets, strict=True))
            if window_crossed(self.target.config, longest + total + 1):
                raise ValueError("this target's sliding-window layers are not batched yet: generate one prompt at a "
                                 "time")
            drafter = None
            if total > 0:
                drafter = batch_drafter(self.draft, depth, self.top_k, total, len(rows), longest, self.lookup,
                                        self.lookup_ngrams, trim=not self.static_shapes)
            tokens = decode_rows(self.backend, drafter, rows, budgets, sampling, eos, generator, stats, policy)
        return BatchResult(self._padded(rows, tokens), tokens,
                           [self.tokenizer.decode(t, skip_special_tokens=True) for t in tokens], stats)

    def _padded(self, rows: list[torch.Tensor], tokens: list[list[int]]) -> torch.Tensor:
        """[B, longest prompt + most new tokens]: each prompt left-padded, then its new tokens, then padding."""
        pad = getattr(self.tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else (self.eos_ids(None).tolist() or [0])[0]
        longest, most = max(ids.shape[0] for ids in rows), max(len(t) for t in tokens)
        out = torch.full((len(rows), longest + most), pad, dtype=torch.long)
        for i, (ids, new) in enumerate(zip(rows, tokens, strict=True)):
            out[i, longest - ids.shape[0] : longest] = ids.cpu()
            out[i, longest : longest + len(new)] = torch.tensor(new, dtype=torch.long)
        return out

    def batch_tree(self, rows: int, temperature: float = 0.0) -> tuple[int, int]:
        """(depth, total_tokens) of the tree batches of ``rows`` prompts draft (total 0: the batched plain loop): the
        one tuned for that batch size on this machine (:func:`griffin.autotune.autotune_batch`) when the tree is
        tuned, else the generator's own."""
        if not self.autotuned:
            return self.depth, self.total_tokens
        key = (temperature_band(temperature), rows)
        if key not in self._batch_trees:
            self._batch_trees[key] = autotune_batch(self, rows, retune=self._retune, temperature=key[0])
        return self._batch_trees[key]

    def batch_shapes(self, rows: int, temperature: float = 0.0) -> list[Shape]:
        """The tree shapes batches of ``rows`` prompts adapt between, with plain steps (none: the batch's tree stays
        fixed), when the tree is tuned and ``adapt`` is on: up to :data:`griffin.adapt.ADAPT_ROWS` rows and only where
        the batch size's tuning record kept no tree, its best estimate, priced at that size
        (:func:`griffin.autotune.shapes`; its lookup nodes on the record's forward-cost curve), unless a probe of it
        costs more than :data:`griffin.adapt.PROBE_EXCESS` plain steps beyond what it gives
        (:func:`griffin.adapt.probe_excess`). A batch decides on its slowest row, so adapting around a tree that the
        tuner measured paying drops it whenever one row's acceptance dips, and larger trees for requests that accept
        more cost a batch more than they give: both lost (``benchmarks/results/batch-adapt/``)."""
        if not (self.autotuned and self.adapt) or isinstance(self.draft, DraftLM) or rows > ADAPT_ROWS:
            return []
        key = (temperature_band(temperature), rows)
        if key not in self._batch_shapes:
            kept = self.batch_tree(rows, temperature)[1] > 0  # tuned first if need be
            record = batch_tuning_record(self, rows, key[0]) or {}
            found, curve = shapes(record, self.lookup, count=1, larger=0), pass_cost(record)
            if kept or (found and probe_excess(found[0], curve, self.lookup) > PROBE_EXCESS):
                found = []
            self._batch_shapes[key] = found, curve
        return self._batch_shapes[key][0]

    def batch_policy(self, rows: int, temperature: float = 0.0) -> ShapePolicy | None:
        """A new policy over :meth:`batch_shapes` priced on their record's forward-cost curve (None: no adaptation).
        Batches adapt only where their tuner kept no tree, so its probes start at the longest wait."""
        found = self.batch_shapes(rows, temperature)
        curve = self._batch_shapes[temperature_band(temperature), rows][1] if found else None
        return ShapePolicy(found, plain_first=True, curve=curve) if found else None

    @one_thread_at_a_time
    def stream(self, inputs, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               eos_token_id: int | Sequence[int] | None = None, max_length: int | None = None,
               seed: int | None = None, stats: GenerationStats | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are accepted (incomplete UTF-8 characters are held back until they complete or
        the generation ends); joined, the pieces are ``generate(...).text`` of the same call."""
        if self.encode_batch(inputs) is not None:
            raise ValueError("stream takes one prompt: generate a batch with generate(), or stream each prompt")
        ids, budget, sampling, generator = self._prepare(inputs, max_new_tokens, temperature, top_p, top_k,
                                                         max_length, seed)
        stats = stats if stats is not None else GenerationStats()
        new: list[int] = []
        printed, text = 0, ""
        for chunk in self._steps(ids, budget, sampling, self.eos_ids(eos_token_id), generator, stats):
            new += chunk.tolist()
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            if len(text) > printed:
                yield text[printed:]
                printed = len(text)
        if len(text) > printed:  # held back: the last character, left incomplete by the token budget or the EOS
            yield text[printed:]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             **kwargs) -> GenerationResult | BatchResult:
        """Apply the target's chat template to ``messages`` and generate the assistant's reply (``result.text``); a
        list of conversations is a batch (``result.texts``)."""
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], (list, tuple)):
            return self.generate([check_messages(m) for m in messages], **kwargs)
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


def check_lookup(lookup) -> None:
    if isinstance(lookup, bool) or not isinstance(lookup, int) or lookup < 0:
        raise ValueError(f"lookup must be an integer >= 0 (0 = off), got {lookup!r}")


def context_window(model) -> int | None:
    """The longest sequence the target was built for (``max_position_embeddings``), if its config says."""
    window = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return window if isinstance(window, int) and window > 0 else None


def token_budget(model, prompt_len: int, max_new_tokens: int, max_length: int | None = None) -> int:
    """The new tokens a prompt of ``prompt_len`` tokens may get under ``max_length`` and the target's context
    window."""
    if max_length is not None:
        if prompt_len >= max_length:
            raise ValueError(f"the prompt has {prompt_len} tokens, which leaves no room under max_length="
                             f"{max_length}: raise max_length or shorten the prompt")
        max_new_tokens = min(max_new_tokens, max_length - prompt_len)
    window = context_window(model)
    if window is not None:
        if prompt_len >= window:
            raise ValueError(f"the prompt has {prompt_len} tokens but the target's context window is {window} "
                             "tokens: shorten the prompt")
        if prompt_len + max_new_tokens > window:
            log.warning("generation stops at the target's context window (%d tokens): at most %d new tokens",
                        window, window - prompt_len)
            max_new_tokens = window - prompt_len
    return max_new_tokens


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
        raise ValueError(f"no tokenizer for {name!r} on this machine ({type(err).__name__}): {hint}") from err
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
    raise ValueError(f"no draft head ships for target {str(target_name)!r}: pass draft=<head folder or Hub id> (train "
                     "one with python -m training.build_features and python -m training.train)")
