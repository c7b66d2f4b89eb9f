"""The engine on a GPU with nothing brought along: random-weight targets of real shapes, an oracle, an untrained head.

    python -m benchmarks.gpu_engine --device cuda --dtype bf16 --shapes llama2-7b,llama3-8b
    python -m benchmarks.gpu_engine --shapes llama2-7b --quick --compile --tag compile   # eager and CUDA graphs
    python -m benchmarks.gpu_engine --shapes tiny --device cpu --quick                   # seconds, on any machine

Each target is built on the device itself: meta-device init, then uninitialised device memory filled with N(0, 0.02)
(norms 1), so a 7B model takes seconds and no host memory. Its weights are random and its text meaningless, so an oracle
drafter's τ is exactly what the tree allows: the numbers measure the engine, not a head. Per shape:

1. plain decoding: transformers' ``generate`` and our own one-token loop (ms per token);
2. the target's forward-cost curve t(n): one forward over n = 1..128 new tokens after 512 cached ones
   (synchronised, median of repeats);
3. the oracle ceiling by tree size: EAGLE-2's tree of depth 6 and top-k 10 (the paper's 60 nodes) cut to N nodes, with
   an oracle that proposes the target's own greedy continuation inside it (τ = min(N, 6) + 1), against plain decoding
   and against the forward-cost ceiling τ · t(1) / t(N+1);
4. one cycle of an untrained head (``DraftModel(DraftConfig.from_target(...))``) on the 60-node tree, split into
   draft / verify / other (``SpecGenerator.timing``, which synchronises; every other run goes without);
   engine overhead = cycle - drafting - the verification forward t(61);
5. the tree the tuner (``total_tokens="auto"``) picks for that head (its τ is about 1, so a small one or none);
6. with ``--compile [MODE]``: verification through the engine's compiled static path (``SpecGenerator(compile=MODE)``;
   the default ``reduce-overhead`` records CUDA graphs) and the head's norms, MLP and fusion under ``torch.compile``:
   the time of the first (compiling) calls, t(61), the oracle at 60 nodes and the untrained head's cycle again.

The oracle's reference is transformers' greedy output. In bf16 a forward over N tokens and one over a single token may
round a near-tie differently; where the engine's tokens then differ from the reference, the oracle proposes the
engine's own tokens and the run is repeated (``oracle_passes``); the share of runs identical to ``generate`` is
reported. Results of each shape replace that shape's entry in ``<out-dir>/engine-<gpu>[-<tag>].json`` (and ``.md``),
written after every step, so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

from griffin.cli import run_cli
from griffin.report import command_line, machine_info, markdown_table, write_benchmark

RESULTS = Path("benchmarks/results/gpu")
LLAMA = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, rms_norm_eps=1e-5, hidden_act="silu")
SHAPES = {
    "llama2-7b": dict(LLAMA, num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                      max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama3-8b": dict(LLAMA, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                      max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=256, rms_norm_eps=1e-5, hidden_act="silu",
                 max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
DEPTH, TOP_K, PAPER_TREE = 6, 10, 60  # EAGLE-2's tree on an A100 (the paper's setting)
CONTEXT = 512  # cached tokens before the forwards of the cost curve


@dataclass(frozen=True)
class Plan:
    """How much to measure."""

    prompts: int  # random prompts, each decoded by every method
    prompt_len: int
    new_tokens: int  # per prompt, for plain decoding and the oracle
    untrained_tokens: int  # per prompt, for the untrained head (about one token per cycle)
    tree_sizes: tuple[int, ...]
    cost_sizes: tuple[int, ...]
    repeats: int  # of each size of the cost curve (the median is kept)
    oracle_passes: int = 4


FULL = Plan(prompts=2, prompt_len=448, new_tokens=128, untrained_tokens=64,
            tree_sizes=(1, 2, 3, 4, 6, 10, 16, 24, 32, 48, 60),
            cost_sizes=(*range(1, 17), *range(20, 65, 4), *range(72, 129, 8)), repeats=5)
QUICK = Plan(prompts=2, prompt_len=448, new_tokens=64, untrained_tokens=32, tree_sizes=(1, 2, 4, 6, 16, 60),
             cost_sizes=(1, 2, 4, 8, 16, 32, 64, 128), repeats=3)
TINY = Plan(prompts=1, prompt_len=32, new_tokens=24, untrained_tokens=8, tree_sizes=(1, 6, 60), cost_sizes=(1, 8, 64),
            repeats=2)  # the tiny shape checks the command, on any machine, in seconds


class IdTokenizer:
    """Stands in for a tokenizer with random-weight targets: a character's code point modulo the vocabulary is its id,
    and ids decode to their numbers. Enough for ``SpecGenerator`` and the tree tuner's calibration prompts."""

    eos_token_id = None
    chat_template = "plain"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        return "\n".join(m["content"] for m in messages)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) % self.vocab_size for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama2-7b,llama3-8b", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="default: bf16 on cuda, else fp32")
    p.add_argument("--quick", action="store_true", help="fewer tokens, tree sizes and repeats (tiny: always few)")
    p.add_argument("--compile", nargs="?", const="reduce-overhead", default=None, metavar="MODE",
                   help="also measure compiled verification (torch.compile mode; default reduce-overhead: CUDA "
                   "graphs) and a compiled head")
    p.add_argument("--draft-vocab", type=int, default=0, help="draft vocabulary of the untrained head (0 = full)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="appended to the result file's name (engine-<gpu>-<tag>)")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--table", metavar="FILE.json",
                   help="only write FILE.md from a result file (one brought back from a GPU machine as JSON alone)")
    args = p.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or not args.shapes:
        p.error(f"unknown shape(s) {unknown}: use a comma-separated list from {', '.join(SHAPES)}")
    if args.draft_vocab < 0:
        p.error("--draft-vocab must be >= 0")
    if args.tag and not re.fullmatch(r"[A-Za-z0-9._-]+", args.tag):
        p.error("--tag may hold letters, digits, '.', '_' and '-' only")
    return args


if __name__ == "__main__":  # --help and usage errors answer here, before torch and transformers load
    parse_args()

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from griffin import DraftConfig, DraftModel, GenerationStats, SpecGenerator
from griffin.autotune import autotune, cached_context_forward
from griffin.drafters import OracleDrafter
from griffin.io import atomic_write_json, atomic_write_text
from griffin.plain import plain_generate
from griffin.sampling import SamplingConfig
from griffin.target import resolve_dtype

# --- building ------------------------------------------------------------------------------------------------------


@torch.no_grad()
def random_target(shape: str, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """A Llama of the named shape with N(0, 0.02) weights, built on ``device`` without touching host memory."""
    config = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        if param.dim() > 1:
            param.normal_(0.0, config.initializer_range)
        else:
            param.fill_(0.0 if name.endswith("bias") else 1.0)  # norms
    for name, module in list(model.named_modules()):  # rotary tables are computed, not stored: compute them here
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent = model.get_submodule(name.rpartition(".")[0])
            with torch.device(device):
                setattr(parent, name.rpartition(".")[2], type(module)(config))
    model.config._name_or_path = f"random-{shape}"
    return model.eval().requires_grad_(False)


def untrained_head(target, device: torch.device, draft_vocab: int) -> DraftModel:
    with torch.device(device):
        head = DraftModel(DraftConfig.from_target(target.config, arch="griffin", draft_vocab_size=draft_vocab))
    return head.eval().requires_grad_(False)


COMPILED = ("RMSNorm", "MLP", "Fusion")  # type-name endings of the head's modules put under torch.compile


def compile_head(head: DraftModel) -> int:
    """``torch.compile(dynamic=True)`` the head's RMSNorms, MLP and fusion, which hold its small elementwise kernels
    -> how many modules. Its attention and cache writes stay eager: their shapes change with every drafting level."""
    modules = [m for m in head.modules() if type(m).__name__.endswith(COMPILED)]
    for module in modules:
        module.compile(dynamic=True)
    return len(modules)


# --- measuring -----------------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def settle(model, device: torch.device, seconds: float = 6.0) -> None:
    """Keep the GPU busy with the target's forwards for ``seconds``: an idle GPU runs at a fraction of its clock and
    takes seconds to ramp up, so whatever is timed first would be timed slow. No-op on a CPU."""
    if device.type != "cuda":
        return
    ids = torch.zeros(1, 64, dtype=torch.long, device=device)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        model(ids)
        synchronize(device)


def timed(device: torch.device, fn: Callable):
    """-> (fn(), seconds), the device's queued work included."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def forward_costs(gen: SpecGenerator, sizes: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one target forward over n new tokens after CONTEXT cached ones, sizes interleaved."""
    forward = cached_context_forward(gen, CONTEXT, max(sizes))
    for n in sizes[:3]:
        forward(n)  # warm-up
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            times[n].append(timed(gen.device, lambda n=n: forward(n))[1])
    return {n: sorted(t)[len(t) // 2] for n, t in times.items()}


@torch.inference_mode()
def static_forward_cost(gen: SpecGenerator, n: int, repeats: int) -> float:
    """Median seconds of one verification forward over n tokens after CONTEXT cached ones through the generator's own
    backend and KV buffer (its compiled static path when it has one)."""
    backend = gen.backend
    ids = torch.randint(0, gen.target.config.vocab_size, (CONTEXT + n,), device=gen.device)
    cache = backend.prepare(CONTEXT + n)
    backend.prefill(ids[:CONTEXT])
    mask = torch.ones(n, n, dtype=torch.bool, device=gen.device).tril()
    positions = torch.arange(CONTEXT, CONTEXT + n, device=gen.device)

    def forward() -> None:
        backend.forward(ids[CONTEXT:], positions, mask)
        cache.crop(CONTEXT)

    forward()  # warm-up
    times = sorted(timed(gen.device, forward)[1] for _ in range(repeats))
    return times[len(times) // 2]


def hf_generate(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=new_tokens,
                              do_sample=False, top_p=None, top_k=None, temperature=None)[0, ids.shape[0]:]


def oracle_generate(gen: SpecGenerator, ids: torch.Tensor, reference: list[int], total: int, new_tokens: int,
                    passes: int) -> tuple[GenerationStats, float, int, bool]:
    """Generate with an oracle proposing ``reference`` inside a ``total``-node tree -> (stats, seconds of the last run,
    runs, whether its output equals what it was proposed). Where the engine's greedy tokens differ from the proposal,
    the next run proposes the engine's own tokens."""
    for attempt in range(1, passes + 1):
        drafter = OracleDrafter(reference, depth=DEPTH, top_k=TOP_K, total_tokens=total, mode="tree",
                                vocab_size=gen.target.config.vocab_size)
        result, seconds = timed(gen.device, lambda d=drafter: gen.generate(ids, max_new_tokens=new_tokens, drafter=d))
        emitted = result.sequences[0, ids.shape[0]:].tolist()
        if emitted == reference:
            return result.stats, seconds, attempt, True
        reference = emitted
    return result.stats, seconds, passes, False


def cycles_of(stats: list[GenerationStats], split: bool = False) -> dict:
    """Cycles and τ of some generations, with their per-cycle draft / verify / other split when ``split``."""
    cycles = sum(s.cycles for s in stats)
    out = {"cycles": cycles, "tau": sum(s.new_tokens for s in stats) / cycles}
    if split:
        parts = {k: sum(getattr(s, k) for s in stats) / cycles for k in ("draft_s", "verify_s", "other_s")}
        if not any(parts.values()):
            raise RuntimeError("the generator reported no draft / verify / other time: its timing split is off")
        out.update(parts, cycle_s=sum(parts.values()))
    return out


class Shape:
    """Every measurement of one target shape, recorded into ``self.result`` as it goes."""

    def __init__(self, name: str, args: argparse.Namespace, plan: Plan, report: Report):
        self.name, self.args, self.plan, self.report = name, args, plan, report
        self.device, dtype = args.device, resolve_dtype(args.dtype)
        torch.manual_seed(args.seed)
        self.model, build_s = timed(self.device, lambda: random_target(name, self.device, dtype))
        head = untrained_head(self.model, self.device, args.draft_vocab)
        vocab = self.model.config.vocab_size
        self.gen = SpecGenerator(self.model, IdTokenizer(vocab), head, depth=DEPTH, top_k=TOP_K,
                                 total_tokens=PAPER_TREE, draft_dtype=dtype)
        self.dtype = dtype
        rng = torch.Generator().manual_seed(args.seed)
        self.prompts = [torch.randint(0, vocab, (plan.prompt_len,), generator=rng).to(self.device)
                        for _ in range(plan.prompts)]
        self.result: dict = {
            "shape": name, "config": {k: v for k, v in SHAPES[name].items() if k != "hidden_act"},
            "parameters": sum(p.numel() for p in self.model.parameters()), "head_parameters": head.num_parameters(),
            "dtype": args.dtype, "device": str(self.device), "plan": asdict(plan), "build_s": build_s,
            "tree": {"depth": DEPTH, "top_k": TOP_K}, "draft_vocab": args.draft_vocab, "complete": False,
            "command": command_line("benchmarks.gpu_engine", getattr(args, "argv", None)),
            "date": machine_info()["date"],
        }
        self.references: list[list[int]] = []

    def save(self) -> None:
        self.report.save(self.name, self.result)

    def warm_up(self) -> None:
        ids = self.prompts[0][:32]
        self.gen.generate(ids, max_new_tokens=8)
        hf_generate(self.model, ids, 8)
        plain_generate(self.model, ids, 8, SamplingConfig(), self.gen.eos_ids(None))
        settle(self.model, self.device)

    def plain(self, key: str = "plain") -> None:
        n, eos = self.plan.new_tokens, self.gen.eos_ids(None)
        hf_s = own_s = 0.0
        references = []
        for ids in self.prompts:
            ref, seconds = timed(self.device, lambda ids=ids: hf_generate(self.model, ids, n))
            references.append(ref.tolist())
            hf_s += seconds
            own, seconds = timed(self.device, lambda ids=ids: plain_generate(self.model, ids, n, SamplingConfig(), eos))
            own_s += seconds
        tokens = n * len(self.prompts)
        self.result[key] = {"generate_step_s": hf_s / tokens, "own_loop_step_s": own_s / tokens,
                            "generate_s": hf_s, "own_loop_s": own_s, "tokens": tokens}
        if not self.references:
            self.references = references
        self.save()

    def costs(self, key: str = "forward_cost_s", sizes: list[int] | None = None) -> None:
        wanted = sorted({1, *(sizes or self.plan.cost_sizes), *(n + 1 for n in self.plan.tree_sizes)})
        self.result[key] = {str(n): v for n, v in forward_costs(self.gen, wanted, self.plan.repeats).items()}
        self.save()

    def oracle(self, key: str = "oracle", sizes: tuple[int, ...] | None = None, gen: SpecGenerator | None = None,
               costs: dict[str, float] | None = None) -> None:
        """The oracle at each tree size: τ, wall time (timing off), speedups and the forward-cost ceiling."""
        gen, t = gen or self.gen, costs or self.result["forward_cost_s"]
        rows = self.result.setdefault(key, {})
        base = self.result["plain"]
        for total in sizes or self.plan.tree_sizes:
            stats, seconds, runs, identical = [], 0.0, 0, 0
            for ids, ref in zip(self.prompts, self.references):
                s, sec, passes, _ = oracle_generate(gen, ids, ref, total, self.plan.new_tokens,
                                                    self.plan.oracle_passes)
                stats.append(s)
                seconds += sec
                runs += passes
                identical += passes == 1
            cycles = cycles_of(stats)
            ceiling = cycles["tau"] * t["1"] / t[str(total + 1)]
            speedup = base["generate_s"] / seconds
            rows[str(total)] = {
                **cycles, "cycle_s": seconds / cycles["cycles"], "wall_s": seconds, "speedup_vs_generate": speedup,
                "speedup_vs_own_loop": base["own_loop_s"] / seconds, "ceiling": ceiling,
                "efficiency_vs_generate": speedup / ceiling, "efficiency_vs_own_loop":
                base["own_loop_s"] / seconds / ceiling, "identical_to_generate": identical / len(self.prompts),
                "oracle_runs": runs}
            self.save()

    def untrained(self, key: str = "untrained", gen: SpecGenerator | None = None,
                  verify_forward: float | None = None) -> None:
        """The untrained head on the 60-node tree, its cycle split (timing on) and the engine's overhead."""
        gen = gen or self.gen
        stats, identical = [], 0
        gen.timing = True
        try:
            for ids, ref in zip(self.prompts, self.references):
                result = gen.generate(ids, max_new_tokens=self.plan.untrained_tokens)
                stats.append(result.stats)
                identical += result.sequences[0, ids.shape[0]:].tolist() == ref[: self.plan.untrained_tokens]
        finally:
            gen.timing = False
        split = cycles_of(stats, split=True)
        verify_forward = verify_forward or self.result["forward_cost_s"][str(PAPER_TREE + 1)]
        overhead = split["cycle_s"] - split["draft_s"] - verify_forward
        self.result[key] = {**split, "total_tokens": PAPER_TREE, "verify_forward_s": verify_forward,
                            "engine_overhead_s": overhead, "engine_overhead_share": overhead / split["cycle_s"],
                            "identical_to_generate": identical / len(self.prompts)}
        self.save()

    def tune(self) -> None:
        with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, {"GRIFFIN_CACHE": cache}):
            (depth, _, total), seconds = timed(self.device, lambda: autotune(self.gen, retune=True))
            choice = json.loads(next((Path(cache) / "autotune").glob("*.json")).read_text())
        self.result["autotune"] = {"depth": depth, "total_tokens": total, "expected_tau": choice["expected_tau"],
                                   "expected_speedup": choice["expected_speedup"],
                                   "tuner_forward_cost_s": choice["forward_cost_s"], "seconds": seconds}
        self.save()

    def compiled(self) -> None:
        """Verification through the engine's compiled static path and a compiled head: the first (compiling) calls,
        t(61), the oracle at 60 nodes and the untrained head's cycle."""
        mode = self.args.compile
        record = self.result["compile"] = {
            "mode": mode, "verification": f"SpecGenerator(compile={mode!r})",
            "head": "torch.compile(dynamic=True) of its RMSNorms, MLP and fusion"}
        try:
            gen = SpecGenerator(self.model, self.gen.tokenizer, self.gen.draft, depth=DEPTH, top_k=TOP_K,
                                total_tokens=PAPER_TREE, draft_dtype=self.dtype, compile=mode)
            record["head_modules"] = compile_head(gen.draft)
            first = timed(self.device, lambda: gen.generate(self.prompts[0][:32], max_new_tokens=8))
            record["first_calls_s"] = first[1]
            self.save()
            eager = self.result["forward_cost_s"]
            t = record["verify_forward_s"] = static_forward_cost(gen, PAPER_TREE + 1, self.plan.repeats * 3)
            self.oracle("compile_oracle", (PAPER_TREE,), gen, {"1": eager["1"], str(PAPER_TREE + 1): t})
            self.untrained("compile_untrained", gen, t)
            from torch._dynamo.utils import counters

            record["dynamo_stats"] = dict(counters["stats"])
        except Exception as err:  # a failed compile is a result too: report it beside the eager numbers
            record["error"] = f"{type(err).__name__}: {err}"[:2000]
        self.save()

    def run(self) -> None:
        self.warm_up()
        self.plain()
        self.costs()
        self.oracle()
        self.untrained()
        self.tune()
        if self.args.compile:
            self.compiled()
        self.result["complete"] = True
        self.report.save(self.name, self.result, final=True)

    def close(self) -> None:
        del self.gen, self.model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.args.compile:
            torch.compiler.reset()


class Report:
    """The result file of one GPU (``<stem>.json`` and ``.md``): shapes measured now replace their earlier entries."""

    def __init__(self, out_dir: str, stem: str, gpu: dict):
        self.out_dir, self.stem, self.gpu = Path(out_dir), stem, gpu
        path = self.out_dir / f"{stem}.json"
        self.result = json.loads(path.read_text()) if path.is_file() else {"shapes": {}}

    def save(self, name: str, shape: dict, final: bool = False) -> None:
        """Record a shape's results so far (atomically); ``final`` also prints the table."""
        self.result.update(gpu=self.gpu, machine=machine_info())
        self.result["shapes"][name] = shape
        if final:
            write_benchmark(self.out_dir, self.stem, self.result, table(self.result))
        else:
            atomic_write_json(self.out_dir / f"{self.stem}.json", self.result)
            atomic_write_text(self.out_dir / f"{self.stem}.md", table(self.result))


# --- reporting -----------------------------------------------------------------------------------------------------


def gpu_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": "cpu"}
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "memory_gb": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version()}


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def check(value: float, target: float, at_most: bool) -> str:
    met = value <= target if at_most else value >= target
    return f"{value:.0%} ({'met' if met else 'not met'}: target {'≤' if at_most else '≥'} {target:.0%})"


def shape_table(r: dict) -> str:
    ms = 1000
    c = r["config"]
    head = (f"## {r['shape']}: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
            f"{c['num_attention_heads']} heads ({c['num_key_value_heads']} KV), intermediate "
            f"{c['intermediate_size']}, vocabulary {c['vocab_size']}, RoPE θ {c['rope_parameters']['rope_theta']:g}; "
            f"{r['parameters'] / 1e9:.2f} B parameters in {r['dtype']} (built in {r['build_s']:.1f} s)"
            f"{'' if r['complete'] else ' — INCOMPLETE (stopped early)'}\n\n")
    parts = [head]
    if "plain" in r:
        p = r["plain"]
        parts.append(f"Plain decoding: transformers' `generate` {p['generate_step_s'] * ms:.2f} ms/token, our "
                     f"one-token loop {p['own_loop_step_s'] * ms:.2f} ms/token ({p['tokens']} tokens).\n\n")
    if "forward_cost_s" in r:
        costs = r["forward_cost_s"]
        rows = [[n, v * ms, v / costs["1"]] for n, v in costs.items()]
        parts.append(f"### Target forward cost over n new tokens ({CONTEXT} cached)\n\n"
                     + markdown_table(["n", "ms", "relative to n=1"], rows) + "\n")
    if "oracle" in r:
        rows = [[n, o["tau"], o["cycle_s"] * ms, o["speedup_vs_generate"], o["speedup_vs_own_loop"],
                 o["ceiling"], f"{o['efficiency_vs_generate']:.0%}", f"{o['identical_to_generate']:.0%}",
                 o["oracle_runs"]] for n, o in r["oracle"].items()]
        parts.append("### Oracle ceiling by tree size (depth 6, top-k 10, cut to N nodes)\n\n" + markdown_table(
            ["N", "τ", "ms/cycle", "speedup vs generate", "vs own loop", "ceiling τ·t(1)/t(N+1)",
             "speedup / ceiling", "identical to generate", "runs"], rows)
            + "\n`runs`: oracle runs over all prompts (more than one per prompt where the engine's bf16 tokens "
              "differed from `generate`'s and the oracle re-proposed the engine's own).\n\n")
    if "untrained" in r:
        u = r["untrained"]
        share = {k: u[k] / u["cycle_s"] for k in ("draft_s", "verify_s", "other_s")}
        rows = [[k.removesuffix("_s"), u[k] * ms, f"{share[k]:.0%}"] for k in share]
        rows += [["cycle", u["cycle_s"] * ms, "100%"], ["verification forward t(61)", u["verify_forward_s"] * ms,
                                                        f"{u['verify_forward_s'] / u['cycle_s']:.0%}"],
                 ["engine overhead (cycle - draft - t(61))", u["engine_overhead_s"] * ms,
                  f"{u['engine_overhead_share']:.0%}"]]
        parts.append(f"### One cycle of an untrained head, {PAPER_TREE}-node tree (τ {u['tau']:.2f}, {u['cycles']} "
                     f"cycles, identical to generate {u['identical_to_generate']:.0%})\n\n"
                     + markdown_table(["part", "ms", "share"], rows) + "\n")
        targets = [f"- Engine overhead at the {PAPER_TREE}-node tree: {check(u['engine_overhead_share'], 0.15, True)}"]
        if str(PAPER_TREE) in r.get("oracle", {}):
            eff = r["oracle"][str(PAPER_TREE)]["efficiency_vs_generate"]
            targets.append(f"- Oracle speedup over `generate` against the forward-cost ceiling at {PAPER_TREE} "
                           f"nodes: {check(eff, 0.8, False)}")
        parts.append("Issue 14's targets:\n\n" + "\n".join(targets) + "\n\n")
    if "autotune" in r:
        a = r["autotune"]
        tree = f"{a['total_tokens']} nodes, depth {a['depth']}" if a["total_tokens"] else "no draft tree"
        parts.append(f"Tree tuner (`total_tokens=\"auto\"`) for the untrained head: {tree} (expected τ "
                     f"{a['expected_tau']:.2f}; an untrained head's drafts are rejected, so a small tree or none is "
                     f"the right answer), {a['seconds']:.1f} s.\n\n")
    if "compile" in r:
        parts.append(compile_table(r))
    parts.append(f"Command: `{r['command']}` ({r['date']})\n\n")
    return "".join(parts)


def compile_table(r: dict) -> str:
    ms, c = 1000, r["compile"]
    title = f"### Compiled: {c['verification']}, head: {c['head']}\n\n"
    if "error" in c:
        return title + f"Failed: `{c['error'][:500]}`\n\n"
    key = str(PAPER_TREE)
    rows = [["first calls (compiling), s", "-", c.get("first_calls_s", float("nan"))]]
    if "verify_forward_s" in c:
        rows.append([f"verification forward t({PAPER_TREE + 1}), ms", r["forward_cost_s"][str(PAPER_TREE + 1)] * ms,
                     c["verify_forward_s"] * ms])
    if key in r.get("compile_oracle", {}):
        e, k = r["oracle"][key], r["compile_oracle"][key]
        rows += [[f"oracle {key} nodes, ms/cycle", e["cycle_s"] * ms, k["cycle_s"] * ms],
                 [f"oracle {key} nodes, speedup vs generate", e["speedup_vs_generate"], k["speedup_vs_generate"]],
                 [f"oracle {key} nodes, speedup / ceiling", f"{e['efficiency_vs_generate']:.0%}",
                  f"{k['efficiency_vs_generate']:.0%}"]]
    if "compile_untrained" in r:
        e, k = r["untrained"], r["compile_untrained"]
        rows += [[f"untrained head {key} nodes, {part} ms", e[f"{part}_s"] * ms, k[f"{part}_s"] * ms]
                 for part in ("draft", "verify", "other", "cycle")]
        rows.append(["engine overhead share", f"{e['engine_overhead_share']:.0%}", f"{k['engine_overhead_share']:.0%}"])
    return title + markdown_table(["measure", "eager", "compiled"], rows) + "\n"


def table(result: dict) -> str:
    m, g = result["machine"], result["gpu"]
    where = (f"{g['name']} ({g['memory_gb']} GiB, {g['multiprocessors']} SMs), CUDA {g['cuda']}"
             if g["name"] != "cpu" else f"{m['cpu']}, {m['cores']} cores")
    intro = (f"# Engine on {g['name']}: overhead and ceiling with random-weight targets\n\n"
             f"{where}, torch {m['torch']}, transformers {m['transformers']}. Random weights give meaningless text, "
             "so an oracle drafter's τ is what the tree allows: these numbers measure the engine. Speedups are over "
             "transformers' `generate` on the same prompts and token budget, in the same process; the ceiling is "
             "τ · t(1) / t(N+1) from the forward-cost curve.\n\n")
    caveats = "".join(f"- {c}\n" for c in result.get("caveats", []))  # added by hand where a run was flawed
    return intro + (f"Read with care:\n\n{caveats}\n" if caveats else "") + "".join(
        shape_table(r) for r in result["shapes"].values())


def write_table(path: Path, markdown: Callable[[dict], str]) -> int:
    """``path``'s markdown beside it (``.md``), made from the result file ``path``."""
    if not path.is_file():
        raise ValueError(f"--table {path}: no such file")
    atomic_write_text(path.with_suffix(".md"), markdown(json.loads(path.read_text())))
    print(f"wrote {path.with_suffix('.md')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = argv
    if args.table:
        return write_table(Path(args.table), table)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA GPU")
    args.dtype = args.dtype or ("bf16" if args.device.type == "cuda" else "fp32")
    gpu = gpu_info(args.device)
    report = Report(args.out_dir, f"engine-{slug(gpu['name'])}" + (f"-{args.tag}" if args.tag else ""), gpu)
    for name in args.shapes:
        shape = Shape(name, args, TINY if name == "tiny" else QUICK if args.quick else FULL, report)
        print(f"{name}: {shape.result['parameters'] / 1e9:.2f} B parameters built in {shape.result['build_s']:.1f} s",
              file=sys.stderr)
        shape.run()
        shape.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, (RuntimeError,)))
