"""Offline acceptance length τ: replay the engine's cycles with only the draft head, against a stored continuation.

    python -m inference.tau --heads checkpoints/smollm2-135m-instruct-griffin --bench mt_bench --temperatures 0
    python -m inference.tau --heads checkpoints/a checkpoints/b --bench mt_bench --temperatures 0 1 --limit 20 \\
        --total-tokens 24 --depth 5 --top-k 8 --out benchmarks/results/a-vs-b
    python -m inference.tau --bench gsm8k --temperatures 0 1      # only build (or finish) the continuation cache
    python -m inference.tau --heads checkpoints/smollm2-135m-instruct-griffin \\
        --references benchmarks/results/humaneval-smollm2-135m-instruct-griffin-T0.json --engine-check 10

Python: ``evaluate_heads({"a": "checkpoints/a", "b": draft_model}, bench="mt_bench", temperature=0, limit=20)``
returns ``{name: TauResult}`` (``.tau``, ``.tau_se``, ``.alpha()``, ``.accepted_hist()``, ``.prompts``).

Why no target in the loop gives the engine's τ:

- Greedy (T=0). The engine's output is the target's greedy continuation ``c`` (lossless). In a cycle whose root is
  the newest emitted token, the engine accepts the deepest tree node whose path from the root spells the next tokens
  of ``c`` (at each node the target's argmax is the next token of ``c``) and emits that path plus the bonus, which is
  the next token of ``c``. So the accepted path follows from the tree and ``c`` alone. The head is then fed exactly
  what :func:`griffin.decode.decode` feeds it: ``drafter.accept(emitted, hidden[path])``, where
  ``hidden[path]`` are the target's features at the root and the accepted nodes, i.e. at the positions of the tokens
  that *predicted* the emitted ones. Those are the target's features of ``prompt + c`` at positions ``n .. n+m-1``
  (``n``: the root's position, ``m``: tokens emitted), which one causal forward over ``prompt + c[:-1]`` gives.
- Sampling (T>0), with the tree rule of docs/design.md#tree-sampling (draft tokens are deterministic proposals, q =
  δ). At a node with target distribution ``p`` the engine tries its children in draft order, accepting child ``c``
  with probability ``p(c)`` of what is left and zeroing it on rejection; the token it emits at that node (an accepted
  child, or the bonus from what is left) is distributed exactly as ``p``, and the walk goes on below the node iff that
  token is one of the node's children: a child's token can only be emitted by accepting that child, since rejecting it
  removes it from the bonus distribution. So each emitted token is a draw from the target's ``p`` given the tokens
  before it (the output S is a sample of the target), and the walk through each tree, hence the number of cycles, is
  the one the greedy rule above finds for S: cycles = f(S) with f the deterministic replay (the trees depend only on
  the tokens and features before them). The engine's run is (S, f(S)) with S ~ target; replaying f on a continuation
  S' *sampled from the target* (plain decoding, seeded per prompt, the same :func:`griffin.sampling.warp`) gives (S',
  f(S')) with S' ~ target: τ has exactly the engine's distribution, though it is not the engine's τ for the same seed
  (the engine draws other random numbers).

What is not mirrored bit for bit: the engine takes the features of accepted tokens from its tree-verification
forwards, this module from one causal forward over the continuation (the prompt's features come from the same
prefill call as the engine's). They differ by float rounding, which can flip a near-tie among draft scores and so
change a tree now and then: per-prompt τ agrees exactly for most prompts and the mean within noise
(``--engine-check N`` measures it on your machine; ``tests/test_tau.py`` checks it on tiny models).

Continuations are cached as token ids (JSON, one record per line, rewritten atomically after every prompt, so a
killed run resumes) under ``benchmarks/results/continuations/``, keyed by target fingerprint, bench, temperature,
seed, max new tokens and limit. MT-Bench's second turn follows the continuation of the first, as in
:mod:`inference.speed`. Greedy continuations are generated with the shipped head (lossless, faster), sampled ones by
plain decoding with a per-prompt seed (``seed + question_id + 1000 * turn``, as :mod:`inference.speed`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from griffin.cli import run_cli
from griffin.constants import EMBEDDED_TARGET
from griffin.report import (
    command_line,
    machine_info,
    machine_text,
    markdown_table,
    paired_difference,
    pooled_tau,
    write_benchmark,
)

from .questions import BENCHES, EXTRA_BENCHES, load_questions

CONTINUATIONS = Path("benchmarks/results/continuations")
FORMAT = 1  # version of the continuation file layout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference.tau", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", nargs="*", default=[], help="head folders or Hub ids (none: only build continuations)")
    p.add_argument("--bench", default="mt_bench",
                   help=f"{', '.join(BENCHES + EXTRA_BENCHES)}, or a prompt file (.jsonl with 'turns' or 'prompt', "
                        ".txt)")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0])
    p.add_argument("--limit", type=int, default=None, help="only the first n questions")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="base seed of the sampled continuations")
    p.add_argument("--total-tokens", type=int, default=24, help="tree size (draft nodes)")
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="target dtype")
    p.add_argument("--draft-dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="head dtype while drafting (auto: as the engine, bf16 where the CPU computes it natively)")
    p.add_argument("--continuations", default=str(CONTINUATIONS), help="folder of the continuation cache")
    p.add_argument("--references", nargs="*", default=[],
                   help="speed-run JSONs (inference.speed, one head) to compare with: each sets a temperature and its "
                        "questions (replacing --temperatures and --limit); per-prompt τ is compared")
    p.add_argument("--engine-check", type=int, default=0, metavar="N",
                   help="also run the real engine on the first N prompts of each temperature and compare its τ with "
                        "the replay of its output")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--out", default=None,
                   help="result path without suffix: writes <out>.json and <out>.md (default: benchmarks/results/"
                        "tau-<bench>-<heads>)")
    args = p.parse_args(argv)
    args.argv = argv
    for flag in ("max_new_tokens", "total_tokens", "depth", "top_k", "threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be at least 1")
    if args.engine_check < 0:
        p.error("--engine-check must be >= 0")
    if any(t < 0 for t in args.temperatures):
        p.error("--temperatures must be >= 0")
    if len({f"{t:g}" for t in args.temperatures}) < len(args.temperatures):
        p.error("--temperatures lists a temperature twice")
    return args


if __name__ == "__main__":  # --help and usage errors answer here, before torch and transformers load
    parse_args()

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from griffin import DraftModel, SpecGenerator
from griffin.chat_template import prompt_ids
from griffin.drafters import HeadDrafter
from griffin.family import verification_mask
from griffin.generator import default_head, fast_draft_dtype
from griffin.hub import resolve
from griffin.io import atomic_write_text, read_journal, weights_digest
from griffin.kernels import WeightMajorLinears, choose_kernels
from griffin.kv_cache import BufferCache, cached_forward
from griffin.plain import plain_generate
from griffin.progress import progress as progress_bar
from griffin.sampling import SamplingConfig
from griffin.target import cache_dir, file_lock, load_target, resolve_dtype, target_fingerprint
from griffin.tree import Tree
from griffin.verify import follow

# --- prompts and continuations ----------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One prompt and the target's continuation of it (token ids)."""

    question_id: int | str
    turn: int
    prompt: list[int]
    continuation: list[int]

    def as_dict(self) -> dict:
        return {"question_id": self.question_id, "turn": self.turn, "prompt": self.prompt,
                "continuation": self.continuation}


def load_bench(bench: str, limit: int | None = None) -> tuple[str, list[dict]]:
    """A bench name (``mt_bench``, ``humaneval``, ``gsm8k``, ``extra_tasks``) or a prompt file -> (its name in file
    names, questions).

    Prompt files: ``.jsonl`` with ``turns`` (a list of user turns) or ``prompt`` per line, or ``.txt`` with one
    prompt per line. Questions have ``question_id`` and ``turns``."""
    if bench in BENCHES + EXTRA_BENCHES:
        return bench, load_questions(bench, limit)
    path = Path(bench)
    if not path.is_file():
        raise FileNotFoundError(f"unknown bench {bench!r}: choose from {', '.join(BENCHES + EXTRA_BENCHES)} or pass a "
                                "prompt file "
                                "(.jsonl with 'turns' or 'prompt' per line, or .txt with one prompt per line)")
    text = path.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    questions = []
    for i, line in enumerate(lines):
        if path.suffix == ".jsonl":
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{i + 1} is not JSON: {err}") from None
            turns = record.get("turns") or ([record["prompt"]] if "prompt" in record else None)
            if not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{path}:{i + 1} has neither 'turns' (a list of strings) nor 'prompt'")
            questions.append({"question_id": record.get("question_id", i), "turns": turns,
                              "category": record.get("category")})
        else:
            questions.append({"question_id": i, "turns": [line]})
    if not questions:
        raise ValueError(f"{path} holds no prompts")
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{path.stem}-{digest}", questions[:limit] if limit else questions


def continuation_path(folder: str | Path, target_name: str, fingerprint: str, bench: str, temperature: float,
                      seed: int, max_new_tokens: int, limit: int | None) -> Path:
    name = Path(str(target_name)).name
    return Path(folder) / (f"{bench}-{name}-{fingerprint[:8]}-T{temperature:g}-seed{seed}-n{max_new_tokens}-"
                           f"{'all' if limit is None else f'first{limit}'}.json")


def _read_cache(path: Path, settings: dict) -> tuple[list[Sample], bool]:
    """(samples, complete) of a cache file written with the same settings, else ([], False)."""
    if not path.is_file():
        return [], False
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    if header.get("settings") != settings:
        return [], False
    return [Sample(**json.loads(line)) for line in lines[1:]], bool(header.get("complete"))


def _write_cache(path: Path, settings: dict, samples: list[Sample], complete: bool) -> None:
    header = json.dumps({"format": FORMAT, "settings": settings, "complete": complete})
    atomic_write_text(path, "\n".join([header] + [json.dumps(s.as_dict()) for s in samples]) + "\n")


class ContinuationGenerator:
    """The target's continuation of one prompt: greedy through the speculative engine (identical to plain greedy
    decoding, faster), sampled by plain decoding with a given seed."""

    def __init__(self, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, temperature: float,
                 max_new_tokens: int, head: str | Path | DraftModel | None = None):
        self.target, self.tokenizer, self.max_new_tokens = target, tokenizer, max_new_tokens
        self.sampling = SamplingConfig(temperature)
        self.device = next(target.parameters()).device
        self.engine = None
        if self.sampling.greedy:
            if head is None:
                try:
                    head = default_head(target.config._name_or_path)
                except ValueError:
                    head = None  # no shipped head: plain greedy decoding gives the same tokens
            if head is not None:
                self.engine = SpecGenerator.from_pretrained(target, head, tokenizer=tokenizer, depth=5, top_k=8,
                                                            total_tokens=24)
        eos = target.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), dtype=torch.long,
                                device=self.device)

    def __call__(self, ids: list[int], seed: int) -> list[int]:
        prompt = torch.tensor(ids, dtype=torch.long, device=self.device)
        if self.engine is not None:
            out = self.engine.generate(prompt, max_new_tokens=self.max_new_tokens, eos_token_id=self.eos.tolist())
            return out.sequences[0, len(ids):].tolist()
        generator = None if self.sampling.greedy else torch.Generator().manual_seed(seed)
        return plain_generate(self.target, prompt, self.max_new_tokens, self.sampling, self.eos, generator).tolist()


def continuations(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, bench: str = "mt_bench",
                  temperature: float = 0.0, seed: int = 0, max_new_tokens: int = 128, limit: int | None = None,
                  folder: str | Path = CONTINUATIONS, head: str | Path | DraftModel | None = None,
                  progress: bool = True) -> list[Sample]:
    """The target's continuations of a bench's prompts, from the cache or generated (and cached) prompt by prompt.

    A complete cache of all questions also serves any ``limit`` (per-prompt seeds do not depend on the limit)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    name, questions = load_bench(bench, limit)
    target_name = str(target.config._name_or_path)
    fingerprint = target_fingerprint(target.config)
    settings = {"target": Path(target_name).name, "fingerprint": fingerprint, "bench": name,
                "temperature": temperature, "seed": seed, "max_new_tokens": max_new_tokens}
    path = continuation_path(folder, target_name, fingerprint, name, temperature, seed, max_new_tokens, limit)
    if limit is not None:
        whole, complete = _read_cache(
            continuation_path(folder, target_name, fingerprint, name, temperature, seed, max_new_tokens, None),
            settings)
        wanted = {q["question_id"] for q in questions}
        if complete and wanted <= {s.question_id for s in whole}:
            return [s for s in whole if s.question_id in wanted]
    samples, complete = _read_cache(path, settings)
    if complete:
        return samples
    with file_lock(cache_dir() / "locks" / f"{path.name}.lock"):  # one writer per file: a second run waits, then reads
        return _generate_missing(target, tokenizer, questions, path, settings, head, progress)


def _generate_missing(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, questions: list[dict], path: Path,
                      settings: dict, head: str | Path | DraftModel | None, progress: bool) -> list[Sample]:
    samples, complete = _read_cache(path, settings)
    if complete:
        return samples
    done = {(s.question_id, s.turn): s for s in samples}
    ordered = []
    generate = None
    temperature = settings["temperature"]
    bar = progress_bar(total=sum(len(q["turns"]) for q in questions), initial=len(done),
                       desc=f"{settings['bench']} T={temperature:g}", unit="prompt", dynamic_ncols=True,
                       disable=not progress)
    for question in questions:
        messages: list[dict] = []
        for turn, text in enumerate(question["turns"]):
            messages.append({"role": "user", "content": text})
            sample = done.get((question["question_id"], turn))
            if sample is None:
                if generate is None:
                    generate = ContinuationGenerator(target, tokenizer, temperature, settings["max_new_tokens"], head)
                ids = prompt_ids(tokenizer, messages)
                qid = question["question_id"]
                prompt_seed = settings["seed"] + (qid if isinstance(qid, int) else 0) + 1000 * turn
                sample = Sample(qid, turn, ids, generate(ids, prompt_seed))
                samples.append(sample)
                _write_cache(path, settings, samples, complete=False)
                bar.update()
            ordered.append(sample)
            messages.append({"role": "assistant",
                             "content": tokenizer.decode(sample.continuation, skip_special_tokens=True)})
    bar.close()
    _write_cache(path, settings, ordered, complete=True)
    return ordered


# --- the replay -------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def target_features(target: PreTrainedModel, prompt: torch.Tensor, continuation: torch.Tensor,
                    layers: list[int] | None = None) -> torch.Tensor:
    """The target's final-norm hidden states of ``prompt + continuation[:-1]`` -> [P + L - 1, H] (with ``layers``,
    those of a fused-feature head: the hidden states entering these layers, concatenated, [P + L - 1, 3H]).

    The prompt goes through the engine's prefill call (same mask, cache and kernels, so its features are the
    engine's), the continuation through one more forward on top of its KV cache."""
    decoder = target.get_decoder()
    dtype = target.get_output_embeddings().weight.dtype
    p, rest = prompt.shape[0], continuation[:-1]
    cache = BufferCache(target.config.get_text_config().num_hidden_layers, p + rest.shape[0])
    kernels = choose_kernels(target)
    weight_major = WeightMajorLinears(target, kernels.max_rows, "linear", kernels.rows_kernel)
    hidden = []
    for start, tokens in ((0, prompt), (p, rest)):
        q = tokens.shape[0]
        if q == 0:
            continue
        causal = torch.ones(q, q, dtype=torch.bool, device=tokens.device).tril()
        positions = torch.arange(start, start + q, device=tokens.device)
        small = start == 0 and 2 <= q <= weight_major.max_rows  # as TargetBackend.forward on the prompt
        with weight_major if small else contextlib.nullcontext():
            out = cached_forward(decoder, cache, input_ids=tokens[None], position_ids=positions[None],
                                 attention_mask=verification_mask(target, start, causal, dtype),
                                 output_hidden_states=layers is not None)
        hidden.append(out.last_hidden_state[0] if layers is None else
                      torch.cat([out.hidden_states[i][0] for i in layers], dim=-1))
    return torch.cat(hidden)


def accepted_depth(tree: Tree, future: torch.Tensor) -> int:
    """Depth of the path the engine accepts when the target's choices are ``future`` [R >= 1] (the tokens after the
    root): :func:`griffin.verify.follow`; past the end of ``future`` no child matches (the path is cut there)."""
    r = future.shape[0]
    choice = torch.where(tree.depths < r, future[tree.depths.clamp(max=r - 1)], -1)  # [N+1] the token after each node
    return int(follow(tree, choice).length)


@dataclass
class PromptTau:
    """One prompt's replay: the accepted tree depth of each cycle (the bonus not counted)."""

    question_id: int | str
    turn: int
    new_tokens: int
    depths: list[int]
    censored: list[bool]  # the path reached the end of the continuation: deeper acceptance is unknown

    @property
    def cycles(self) -> int:
        return len(self.depths)

    @property
    def tau(self) -> float:
        """As :attr:`griffin.generator.GenerationStats.tau`."""
        return self.new_tokens / self.cycles if self.cycles else float(self.new_tokens)


@torch.inference_mode()
def replay(drafter: HeadDrafter, prompt: torch.Tensor, continuation: torch.Tensor, hidden: torch.Tensor,
           question_id: int | str = 0, turn: int = 0) -> PromptTau:
    """The engine's cycles on ``prompt`` [P] whose output is ``continuation`` [L], with only the drafter.

    hidden [P + L - 1, H]: :func:`target_features`. Mirrors :func:`griffin.decode.decode` line by line."""
    p, total = prompt.shape[0], continuation.shape[0]
    result = PromptTau(question_id, turn, total, [], [])
    if total == 1:  # the prefill's token was the last one
        return result
    drafter.start(prompt, hidden[:p], continuation[:1])
    done = 1  # continuation tokens emitted; the root is continuation[done - 1] at position p + done - 1
    while True:
        tree = drafter.propose(continuation[done - 1 : done])
        future = continuation[done:]
        depth = accepted_depth(tree, future)
        result.depths.append(depth)
        result.censored.append(depth == future.shape[0])
        emitted = continuation[done : done + depth + 1]  # path + bonus, cut at EOS / the budget like the engine
        n = p + done - 1
        done += emitted.shape[0]
        if done >= total:
            return result
        drafter.accept(emitted, hidden[n : n + emitted.shape[0]])  # the features of the root and the path


# --- evaluation -------------------------------------------------------------------------------------------------------


@dataclass
class TauResult:
    """τ of one head on a set of prompts, with per-depth acceptance and the accepted-length histogram."""

    depth: int  # of the draft tree
    prompts: list[PromptTau] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """New tokens per verification pass over all prompts (as :mod:`inference.speed` reports it)."""
        cycles = sum(p.cycles for p in self.prompts)
        tokens = sum(p.new_tokens for p in self.prompts)
        return tokens / cycles if cycles else float("nan")

    @property
    def tau_se(self) -> float:
        """Standard error of :attr:`tau` over prompts (delta method: :func:`griffin.report.pooled_tau`)."""
        return pooled_tau([{"new_tokens": p.new_tokens, "cycles": p.cycles} for p in self.prompts])["se"]

    def alpha(self) -> list[float]:
        """α_d for d = 1..depth: the fraction of cycles whose accepted path reaches depth d among those that reached
        d - 1 (a cycle whose path hit the end of the continuation at depth d - 1 is left out of α_d: unknown)."""
        reached = [0] * (self.depth + 1)
        passed = [0] * (self.depth + 1)
        for p in self.prompts:
            for depth, censored in zip(p.depths, p.censored):
                for d in range(1, min(depth if censored else depth + 1, self.depth) + 1):
                    reached[d] += 1
                    passed[d] += depth >= d
        return [passed[d] / reached[d] if reached[d] else float("nan") for d in range(1, self.depth + 1)]

    def accepted_hist(self) -> dict[int, int]:
        """Tokens emitted per cycle, bonus included -> cycles. As the engine counts: the final cycle emits only what
        is left of the continuation (it may stop at EOS or the budget inside its accepted path)."""
        hist: dict[int, int] = {}
        for p in self.prompts:
            emitted = [depth + 1 for depth in p.depths]
            if emitted:
                emitted[-1] = p.new_tokens - 1 - sum(emitted[:-1])  # the prefill emitted the first token
            for count in emitted:
                hist[count] = hist.get(count, 0) + 1
        return dict(sorted(hist.items()))

    def as_dict(self) -> dict:
        return {"tau": self.tau, "tau_se": self.tau_se, "n_prompts": len(self.prompts),
                "new_tokens": sum(p.new_tokens for p in self.prompts), "cycles": sum(p.cycles for p in self.prompts),
                "alpha": self.alpha(), "accepted_hist": {str(k): v for k, v in self.accepted_hist().items()},
                "per_prompt": [{"question_id": p.question_id, "turn": p.turn, "new_tokens": p.new_tokens,
                                "cycles": p.cycles, "tau": p.tau} for p in self.prompts]}


def prepare_head(head: str | Path | DraftModel, target: PreTrainedModel,
                 draft_dtype: str | torch.dtype | None = "auto") -> DraftModel:
    """A head folder or model -> a copy on the target's device in the engine's draft dtype, attached to the target
    (a model passed in, e.g. one being trained, is left untouched)."""
    device = next(target.parameters()).device
    if draft_dtype == "auto":
        draft_dtype = fast_draft_dtype(device)
    if isinstance(head, DraftModel):
        model = DraftModel(head.config)
        model.load_state_dict(head.state_dict())
    else:
        model = DraftModel.from_pretrained(head)
    dtype = resolve_dtype(draft_dtype) or model.fusion.fc.weight.dtype
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False).attach(target)


def evaluate(heads: Mapping[str, DraftModel], target: PreTrainedModel, samples: Sequence[Sample], depth: int = 5,
             top_k: int = 8, total_tokens: int = 24, progress: bool = True,
             known: Mapping[tuple, PromptTau] | None = None,
             on_prompt: Callable[[str, PromptTau], None] | None = None) -> dict[str, TauResult]:
    """Replay every prompt for every head (attached, in their drafting dtype: :func:`prepare_head`); the target's
    features are computed once per prompt. ``known``: results already at hand, by (head name, question_id, turn);
    ``on_prompt(name, result)`` is called for each new one."""
    for name, value in (("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    known = known or {}
    device = next(target.parameters()).device
    results = {name: TauResult(depth) for name in heads}
    for sample in progress_bar(samples, desc="replay", unit="prompt", dynamic_ncols=True, disable=not progress):
        features: dict[tuple | None, torch.Tensor] = {}  # by the target layers a head reads (None: the last)
        for name, draft in heads.items():
            result = known.get((name, sample.question_id, sample.turn))
            if result is None:
                prompt = torch.tensor(sample.prompt, dtype=torch.long, device=device)
                continuation = torch.tensor(sample.continuation, dtype=torch.long, device=device)
                layers = draft.config.feature_layers
                key = tuple(layers) if layers else None
                if key not in features:
                    features[key] = target_features(target, prompt, continuation, layers)
                drafter = HeadDrafter(draft, depth, top_k, total_tokens, prompt.shape[0] + continuation.shape[0])
                result = replay(drafter, prompt, continuation, features[key], sample.question_id, sample.turn)
                if on_prompt is not None:
                    on_prompt(name, result)
            results[name].prompts.append(result)
    return results


def evaluate_heads(heads: Mapping[str, str | Path | DraftModel], bench: str = "mt_bench", temperature: float = 0.0,
                   limit: int | None = None, tree: tuple[int, int, int] = (24, 5, 8),
                   target: str | PreTrainedModel = EMBEDDED_TARGET, tokenizer: PreTrainedTokenizerBase | None = None,
                   max_new_tokens: int = 128, seed: int = 0, draft_dtype: str | torch.dtype | None = "auto",
                   folder: str | Path = CONTINUATIONS, progress: bool = True) -> dict[str, TauResult]:
    """τ of several heads (folders or models) on a bench: ``{name: TauResult}`` (``.tau``, ``.tau_se``,
    ``.alpha()``, ``.accepted_hist()``, ``.prompts``). ``tree``: (total_tokens, depth, top_k).

        evaluate_heads({"a": "checkpoints/a", "b": model}, bench="mt_bench", temperature=0, limit=20)
    """
    if isinstance(target, PreTrainedModel):
        if tokenizer is None:
            raise ValueError("pass the target's tokenizer along with a loaded target")
        model = target
    else:
        model, loaded = load_target(target)
        tokenizer = tokenizer or loaded
    total_tokens, depth, top_k = tree
    samples = continuations(model, tokenizer, bench, temperature, seed, max_new_tokens, limit, folder,
                            progress=progress)
    prepared = {name: prepare_head(head, model, draft_dtype) for name, head in heads.items()}
    return evaluate(prepared, model, samples, depth, top_k, total_tokens, progress)


# --- checks against the engine ---------------------------------------------------------------------------------


def engine_check(head: DraftModel, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 samples: Sequence[Sample], temperature: float, max_new_tokens: int = 128, depth: int = 5,
                 top_k: int = 8, total_tokens: int = 24, seed: int = 0, progress: bool = True,
                 known: Mapping[tuple, dict] | None = None,
                 on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Run the real engine on the samples' prompts and replay its own output: per prompt, the engine's τ and the
    replay's (equal unless float rounding flips a draft tie; see the module docstring) and, at T=0, whether the
    engine's output is the stored continuation. ``head`` as :func:`prepare_head` returns it. ``known``: rows
    already at hand, by (question_id, turn); ``on_row(row)`` is called for each new one."""
    known = known or {}
    gen = SpecGenerator(target, tokenizer, head, depth=depth, top_k=top_k, total_tokens=total_tokens,
                        draft_dtype=head.fusion.fc.weight.dtype)
    rows = []
    for sample in progress_bar(samples, desc=f"engine T={temperature:g}", unit="prompt", dynamic_ncols=True,
                               disable=not progress):
        qid = sample.question_id
        row = known.get((qid, sample.turn))
        if row is None:
            prompt = torch.tensor(sample.prompt, dtype=torch.long, device=gen.device)
            out = gen.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                               seed=seed + (qid if isinstance(qid, int) else 0) + 1000 * sample.turn)
            new = out.sequences[0, prompt.shape[0]:]
            drafter = HeadDrafter(head, depth, top_k, total_tokens, prompt.shape[0] + new.shape[0])
            hidden = target_features(target, prompt, new, head.config.feature_layers)
            ours = replay(drafter, prompt, new, hidden, qid, sample.turn)
            row = {"question_id": qid, "turn": sample.turn, "engine_tau": out.stats.tau, "replay_tau": ours.tau,
                   "engine_cycles": out.stats.cycles, "replay_cycles": ours.cycles}
            if temperature == 0:
                row["same_output"] = new.tolist() == sample.continuation
            if on_row is not None:
                on_row(row)
        rows.append(row)
    return rows


def compare_reference(result: TauResult, reference: dict) -> dict:
    """The replay's τ against a speed run's (:mod:`inference.speed` JSON with ``per_prompt``) on the same prompts."""
    engine = {(p["question_id"], p["turn"]): p for p in reference["per_prompt"]}
    pairs = [(engine[k], p) for p in result.prompts if (k := (p.question_id, p.turn)) in engine]
    if not pairs:
        raise ValueError("the reference speed run shares no prompt with this evaluation")
    shared = [e for e, _ in pairs]
    diffs = [abs(e["tau"] - p.tau) for e, p in pairs]
    return {"speed_run_tau": reference["tau"], "speed_run_tau_se": pooled_tau(shared)["se"],
            "replay_tau": result.tau, "replay_tau_se": result.tau_se, "n_prompts": len(pairs),
            "same_tau": sum(d < 1e-9 for d in diffs), "mean_abs_diff": sum(diffs) / len(diffs),
            "max_abs_diff": max(diffs), "command": reference.get("command"),
            "draft_dtype": reference.get("draft_dtype")}


# --- command line -----------------------------------------------------------------------------------------------------


def runs_from_references(args: argparse.Namespace) -> list[tuple[float, int | None, dict | None]]:
    """(temperature, limit, reference speed run) for each run: from --references, else --temperatures / --limit."""
    if not args.references:
        return [(t, args.limit, None) for t in args.temperatures]
    runs = []
    bench, questions = load_bench(args.bench)
    for path in args.references:
        try:
            ref = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read the speed run {path}: {err}") from None
        if "per_prompt" not in ref or "tree" not in ref:
            raise ValueError(f"{path} is not a speed-run result of python -m inference.speed")
        mine = {"bench": bench, "max_new_tokens": args.max_new_tokens,
                "tree": {"depth": args.depth, "top_k": args.top_k, "total_tokens": args.total_tokens}}
        for key, value in mine.items():
            if ref.get(key) != value:
                raise ValueError(f"{path} has {key} {ref.get(key)} but this run {value}: pass the matching "
                                 "--bench / --max-new-tokens / --total-tokens / --depth / --top-k")
        n = ref["n_questions"]
        runs.append((float(ref["temperature"]), None if n >= len(questions) else n, ref))
    if len({f"{t:g}" for t, _, _ in runs}) < len(runs):
        raise ValueError("two --references share a temperature: pass one speed run per temperature")
    return runs


class Journal:
    """Per-prompt results of a command-line run, appended to ``.<out>.partial.jsonl`` beside its result so that a
    killed run resumes where it stopped (with the same settings); removed once the result is written."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.done = path, {}
        settings = json.loads(json.dumps(settings))
        records, clean = read_journal(path, settings)
        for record in records:
            self.done[tuple(record["key"])] = record["value"]
        path.parent.mkdir(parents=True, exist_ok=True)
        if not records:
            path.write_text(json.dumps(settings) + "\n")
        elif not clean:  # a line cut by a kill: later appends must not follow it
            atomic_write_text(path, "".join(json.dumps(x) + "\n" for x in [settings, *records]))
        self.handle = open(path, "a")

    def add(self, key: tuple, value: dict) -> None:
        self.handle.write(json.dumps({"key": list(key), "value": value}) + "\n")
        self.handle.flush()

    def replays(self, temperature: str) -> dict[tuple, PromptTau]:
        return {(k[1], k[3], k[4]): PromptTau(**v) for k, v in self.done.items()
                if k[0] == "replay" and k[2] == temperature}

    def engine_rows(self, name: str, temperature: str) -> dict[tuple, dict]:
        return {(k[3], k[4]): v for k, v in self.done.items() if k[:3] == ("engine", name, temperature)}

    def finish(self) -> None:
        self.handle.close()
        self.path.unlink()


def by_category(per_prompt: list[dict], categories: Mapping[int | str, str | None]) -> dict[str, dict]:
    """Per-prompt records -> {category: {"tau", "n_prompts"}}, τ pooled as over all prompts (new tokens / cycles),
    categories in the order of the bench's questions. Empty unless the prompts span two or more categories."""
    groups: dict[str, list[dict]] = {c: [] for c in dict.fromkeys(categories.values()) if c is not None}
    for p in per_prompt:
        if categories.get(p["question_id"]) is not None:
            groups[categories[p["question_id"]]].append(p)
    groups = {c: rows for c, rows in groups.items() if rows}
    if len(groups) < 2:
        return {}
    return {c: {"tau": sum(r["new_tokens"] for r in rows) / sum(r["cycles"] for r in rows), "n_prompts": len(rows)}
            for c, rows in groups.items()}


def head_names(paths: list[str]) -> dict[str, str]:
    """Folder names, or the full paths where two folders share a name."""
    names = [Path(p).name for p in paths]
    return {(Path(p).name if names.count(Path(p).name) == 1 else p): p for p in paths}


def paired_differences(result: dict) -> dict:
    """{T: {head: row}} for every head after the first: the first head's τ minus this head's on the same prompts
    (:func:`griffin.report.paired_difference`: the difference and its standard error, which the pairing makes much
    smaller than either τ's), and the ratio of their τ. Empty with fewer than two heads."""
    names = list(result["heads"])
    out: dict = {}
    for t in result["n_prompts"] if len(names) > 1 else []:
        first = result["heads"][names[0]][t]
        out[t] = {}
        for name in names[1:]:
            run = result["heads"][name][t]
            pair = paired_difference(first["per_prompt"], run["per_prompt"]) or {
                "diff": float("nan"), "se": float("nan"), "n_prompts": 0}
            out[t][name] = {**pair, "ratio": first["tau"] / run["tau"]}
    return out


def table(result: dict) -> str:
    temps = list(result["n_prompts"])
    depth = result["tree"]["depth"]
    headers = ["head"] + [f"τ T={t}" for t in temps] + [f"α{d} T={t}" for t in temps for d in range(1, depth + 1)]
    rows = []
    for name, runs in result["heads"].items():
        row = [name] + [f"{runs[t]['tau']:.2f} ± {runs[t]['tau_se']:.2f}" for t in temps]
        for t in temps:
            row += runs[t]["alpha"]
        rows.append(row)
    tree = result["tree"]
    prompts = ", ".join(f"T={t}: {n}" for t, n in result["n_prompts"].items())
    text = (f"# Offline acceptance length τ · {result['bench']}\n\n"
            f"τ = new tokens per target verification pass, replayed against the target's stored continuations "
            f"(`inference.tau`), pooled over the prompts (all new tokens / all passes); ± is its standard error over "
            f"prompts (delta method). α_d = fraction of cycles whose accepted path reaches depth d among those "
            f"reaching d-1. Tree {tree['total_tokens']} nodes, depth "
            f"{tree['depth']}, top-k {tree['top_k']}; up to {result['max_new_tokens']} new tokens; target "
            f"{result['target']} ({result['dtype']}), draft dtype {result['draft_dtype']}; prompts {prompts}.\n\n"
            + markdown_table(headers, rows))
    paired = paired_differences(result)
    if paired:
        first = next(iter(result["heads"]))
        text += (f"\n## {first} against each other head\n\nPaired over the same prompts: τ({first}) − τ(head) "
                 "± its standard error (delta method, per-prompt residuals paired); ratio of the two τ.\n\n"
                 + markdown_table(
                     ["head", "T", "prompts", f"τ({first}) − τ(head)", f"τ({first}) / τ(head)"],
                     [[name, t, r["n_prompts"], f"{r['diff']:+.3f} ± {r['se']:.3f}", f"{r['ratio']:.3f}"]
                      for t, rows in paired.items() for name, r in rows.items()]))
    refs = [(name, t, runs[t]["reference"]) for name, runs in result["heads"].items() for t in temps
            if "reference" in runs[t]]
    if refs:
        text += ("\n## Against speed runs of the real engine\n\nSame prompts, tree and budget. Per-prompt τ equal: "
                 "prompts whose replayed τ is the speed run's exactly.\n\n" + markdown_table(
                     ["head", "T", "prompts", "speed run τ", "replay τ", "per-prompt τ equal", "mean |Δτ| per prompt",
                      "max |Δτ|"],
                     [[name, t, r["n_prompts"], f"{r['speed_run_tau']:.3f} ± {r['speed_run_tau_se']:.3f}",
                       f"{r['replay_tau']:.3f} ± {r['replay_tau_se']:.3f}", f"{r['same_tau']}/{r['n_prompts']}",
                       f"{r['mean_abs_diff']:.3f}", f"{r['max_abs_diff']:.3f}"] for name, t, r in refs]) +
                 "\nSpeed runs:\n\n" + "".join(f"- `{c}`\n" for c in sorted({r["command"] for _, _, r in refs})))
    for t in temps:
        per_head = {name: runs[t]["categories"] for name, runs in result["heads"].items() if runs[t].get("categories")}
        if per_head:
            first = next(iter(per_head.values()))
            counts = ", ".join(f"{c} {row['n_prompts']}" for c, row in first.items())
            names = list(first)
            text += (f"\n## τ by category, T={t}\n\nPrompts per category: {counts}.\n\n"
                     + markdown_table(["head", *names], [[name, *(f"{cats[c]['tau']:.2f}" if c in cats else "-"
                                                                  for c in names)]
                                                         for name, cats in per_head.items()]))
    checks = [(name, t, runs[t]["engine_check"]) for name, runs in result["heads"].items() for t in temps
              if "engine_check" in runs[t]]
    if checks:
        text += ("\n## Real engine run here, on the same prompts\n\n`SpecGenerator.generate` with the same head, tree "
                 "and draft dtype; the replay is of the engine's own output (at T=0 that is the stored "
                 "continuation).\n\n")
        rows = []
        for name, t, check in checks:
            for row in check:
                rows.append([name, t, f"{row['question_id']}/{row['turn']}", f"{row['engine_tau']:.3f}",
                             f"{row['replay_tau']:.3f}", row.get("same_output", "-")])
        text += markdown_table(["head", "T", "question/turn", "engine τ", "replay τ", "output = stored continuation"],
                               rows)
    machine = result["machine"]
    return text + (f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(machine)}; "
                   f"{result['seconds']:.0f} s.\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    bench, questions = load_bench(args.bench)  # bad input fails before any model is loaded
    categories = {q["question_id"]: q.get("category") for q in questions}
    for path in args.heads:
        if not (resolve(path, kind="draft head") / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a draft head folder: config.json is missing")
    runs = runs_from_references(args)
    if args.references and len(args.heads) != 1:
        raise ValueError("--references compare one head with its speed runs: pass exactly one --heads folder")
    model, tokenizer = load_target(args.target, dtype=args.dtype)
    paths = head_names(args.heads)
    heads = {name: prepare_head(path, model, args.draft_dtype) for name, path in paths.items()}
    results: dict[str, dict] = {name: {} for name in heads}
    n_prompts = {}
    out = Path(args.out or f"benchmarks/results/tau-{bench}-{'-'.join(heads)}")
    journal = None
    if heads:
        settings = {k: v for k, v in vars(args).items() if k not in ("argv", "out", "threads", "continuations")}
        settings["heads"] = {name: [path, weights_digest(path)] for name, path in paths.items()}
        journal = Journal(out.parent / f".{out.name}.partial.jsonl", settings)
    for temperature, limit, reference in runs:
        key = f"{temperature:g}"
        samples = continuations(model, tokenizer, args.bench, temperature, args.seed, args.max_new_tokens, limit,
                                args.continuations)
        n_prompts[key] = len(samples)
        if not heads:
            continue
        evaluated = evaluate(heads, model, samples, args.depth, args.top_k, args.total_tokens,
                             known=journal.replays(key),
                             on_prompt=lambda name, r, key=key: journal.add(
                                 ("replay", name, key, r.question_id, r.turn), asdict(r)))
        for name, res in evaluated.items():
            results[name][key] = res.as_dict()
            results[name][key]["categories"] = by_category(results[name][key]["per_prompt"], categories)
            print(f"{name} T={key}: τ {res.tau:.3f} ± {res.tau_se:.3f} over {len(samples)} prompts")
            if reference is not None:
                results[name][key]["reference"] = compare_reference(res, reference)
            if args.engine_check:
                results[name][key]["engine_check"] = engine_check(
                    heads[name], model, tokenizer, samples[: args.engine_check], temperature, args.max_new_tokens,
                    args.depth, args.top_k, args.total_tokens, args.seed, known=journal.engine_rows(name, key),
                    on_row=lambda row, name=name, key=key: journal.add(
                        ("engine", name, key, row["question_id"], row["turn"]), row))
    if not heads:
        print(f"continuations ready under {args.continuations}")
        return 0
    draft_dtype = str(next(iter(heads.values())).fusion.fc.weight.dtype).removeprefix("torch.")
    result = {"bench": bench, "target": args.target, "dtype": args.dtype,
              "draft_dtype": draft_dtype, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              "tree": {"depth": args.depth, "top_k": args.top_k, "total_tokens": args.total_tokens},
              "limits": {f"{t:g}": limit for t, limit, _ in runs}, "n_prompts": n_prompts, "head_paths": paths,
              "head_digests": {name: weights_digest(path) for name, path in paths.items()},
              "heads": results, "seconds": time.perf_counter() - start, "machine": machine_info(),
              "command": command_line("inference.tau", args.argv)}
    result["paired"] = paired_differences(result)
    write_benchmark(out.parent, out.name, result, table(result))
    journal.finish()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
