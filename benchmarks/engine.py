"""What the speculative engine itself costs and what it can reach, independent of how good a head is.

    python -m benchmarks.engine                     # embedded target, fp32, a few generic prompts

1. **Cycle overhead.** One speculative cycle with an untrained head (it drafts a full tree; almost nothing is accepted)
   against one plain decode step of transformers' ``generate`` and of our own plain loop.
2. **Ceiling.** An oracle drafter proposes exactly the tokens greedy decoding will produce, as a chain of ``d = 1..8``
   tokens and inside a tree of the default size; the speedup over transformers' ``generate`` is the most any head can
   give with this engine on this machine.
3. **Forward-cost curve.** One target forward over ``n`` new tokens, which decides how large a tree pays off; with
   the linear layers as transformers computes them (``F.linear``) and as verification computes them on CPU (weight-major
   for a few rows, :mod:`griffin.kernels`).

All timings come from one process, methods interleaved per prompt after a warm-up. Writes
``benchmarks/results/engine.json`` and ``engine.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from griffin.cli import run_cli
from griffin.constants import EMBEDDED_TARGET

RESULTS = Path("benchmarks/results")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=5, help="tree of the untrained head and the oracle tree")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--total-tokens", type=int, default=24)
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary of the untrained head (0 = full)")
    p.add_argument("--max-chain", type=int, default=8)
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.max_chain < 1:
        p.error("--max-new-tokens and --max-chain must be at least 1")
    return args


if __name__ == "__main__":  # --help and usage errors answer here, before torch and transformers load
    parse_args()

import torch

from griffin import DraftConfig, DraftModel, SpecGenerator
from griffin.autotune import forward_cost
from griffin.drafters import OracleDrafter
from griffin.plain import plain_generate
from griffin.report import command_line, machine_info, machine_text, markdown_table, write_benchmark
from griffin.sampling import SamplingConfig
from griffin.target import load_target

PROMPTS = [  # generic requests, not evaluation questions
    "Explain how a bicycle works.",
    "Write a short story about a lighthouse keeper.",
    "Give three tips for staying focused while studying.",
    "What are the health benefits of drinking water?",
]
COST_SIZES = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 25, 32, 48, 64]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer = load_target(args.target, dtype=args.dtype)
    head = DraftModel(DraftConfig.from_target(model.config, arch="griffin", draft_vocab_size=args.draft_vocab))
    gen = SpecGenerator(model, tokenizer, head, depth=args.depth, top_k=args.top_k, total_tokens=args.total_tokens)
    greedy, eos = SamplingConfig(), gen.eos_ids(None)
    hf = dict(max_new_tokens=args.max_new_tokens, do_sample=False, top_p=None, top_k=None, temperature=None)
    chains = list(range(1, args.max_chain + 1))
    methods = ["generate", "own_loop", "untrained_head", "oracle_tree", *(f"oracle_chain_{d}" for d in chains)]
    seconds = dict.fromkeys(methods, 0.0)
    tokens = dict.fromkeys(methods, 0)
    cycles = dict.fromkeys(methods, 0)
    split = {"draft_s": 0.0, "verify_s": 0.0, "other_s": 0.0}

    def speculative(ids, name, drafter=None):
        gen.timing = name == "untrained_head"  # its draft / verify / other split; the other runs go untimed
        t0 = time.perf_counter()
        result = gen.generate(ids, max_new_tokens=args.max_new_tokens, drafter=drafter)
        seconds[name] += time.perf_counter() - t0
        tokens[name] += result.stats.new_tokens
        cycles[name] += result.stats.cycles
        return result

    warm = gen.encode([{"role": "user", "content": "Hello! Who are you?"}])
    gen.generate(warm, max_new_tokens=16)
    with torch.inference_mode():
        model.generate(warm[None], **{**hf, "max_new_tokens": 16})
    for prompt in PROMPTS:
        ids = gen.encode([{"role": "user", "content": prompt}])
        t0 = time.perf_counter()
        with torch.inference_mode():
            ref = model.generate(ids[None], **hf)
        seconds["generate"] += time.perf_counter() - t0
        reference = ref[0, ids.shape[0]:].tolist()
        tokens["generate"] += len(reference)
        t0 = time.perf_counter()
        own = plain_generate(model, ids, args.max_new_tokens, greedy, eos)
        seconds["own_loop"] += time.perf_counter() - t0
        tokens["own_loop"] += len(own)
        result = speculative(ids, "untrained_head")
        for key in split:
            split[key] += getattr(result.stats, key)
        outputs = [result.sequences, speculative(ids, "oracle_tree", OracleDrafter(
            reference, depth=args.depth, top_k=args.top_k, total_tokens=args.total_tokens, mode="tree",
            vocab_size=model.config.vocab_size)).sequences]
        for d in chains:
            outputs.append(speculative(ids, f"oracle_chain_{d}", OracleDrafter(reference, depth=d)).sequences)
        if not all(torch.equal(o, ref) for o in outputs):
            raise RuntimeError(f"speculative output differs from transformers' generate on {prompt!r}")
    # one target forward over n new tokens after 256 cached ones, with and without weight-major small matmuls
    as_transformers = SpecGenerator(model, tokenizer, head, weight_major_rows=0)
    curves = {"F.linear": forward_cost(as_transformers, COST_SIZES)}
    if gen.weight_major.max_rows:
        curves[f"weight-major up to {gen.weight_major.max_rows} rows"] = forward_cost(gen, COST_SIZES)
    plain_step = seconds["generate"] / tokens["generate"]
    own_step = seconds["own_loop"] / tokens["own_loop"]
    cycle = seconds["untrained_head"] / cycles["untrained_head"]
    result = {
        "target": args.target, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "prompts": PROMPTS,
        "tree": {"depth": args.depth, "top_k": args.top_k, "total_tokens": args.total_tokens},
        "draft_vocab": args.draft_vocab,
        "generate_step_s": plain_step, "own_loop_step_s": own_step, "untrained_cycle_s": cycle,
        "cycle_over_generate_step": cycle / plain_step, "cycle_over_own_step": cycle / own_step,
        "untrained_cycle_split_s": {k: v / cycles["untrained_head"] for k, v in split.items()},
        "untrained_tau": tokens["untrained_head"] / cycles["untrained_head"],
        "oracle": {name: {"tau": tokens[name] / cycles[name], "tokens_per_s": tokens[name] / seconds[name],
                          "speedup_vs_generate": seconds["generate"] / seconds[name]}
                   for name in methods if name.startswith("oracle")},
        "own_loop_speedup_vs_generate": seconds["generate"] / seconds["own_loop"],
        "forward_cost_s": curves,
        "seconds": seconds, "tokens": tokens, "machine": machine_info(), "command": command_line("benchmarks.engine"),
    }
    write_benchmark(args.out_dir, "engine", result, table(result))
    return 0


def table(r: dict) -> str:
    ms = 1000
    split = ", ".join(f"{k.removesuffix('_s')} {v * ms:.0f} ms" for k, v in r["untrained_cycle_split_s"].items())
    costs = markdown_table(["step", "ms", "relative to a generate step"], [
        ["transformers generate, one token", r["generate_step_s"] * ms, 1.0],
        ["our plain loop, one token", r["own_loop_step_s"] * ms, r["own_loop_step_s"] / r["generate_step_s"]],
        [f"speculative cycle, untrained head ({split})", r["untrained_cycle_s"] * ms, r["cycle_over_generate_step"]],
    ])
    oracle = markdown_table(["oracle drafter", "τ", "tokens/s", "speedup vs generate"], [
        [name.replace("oracle_", "").replace("_", " "), o["tau"], o["tokens_per_s"], o["speedup_vs_generate"]]
        for name, o in r["oracle"].items()])
    rows = []
    for kernel, costs_n in r["forward_cost_s"].items():
        first = next(iter(costs_n.values()))
        rows += [[f"ms ({kernel})", *(v * ms for v in costs_n.values())],
                 [f"relative to n=1 ({kernel})", *(v / first for v in costs_n.values())]]
    sizes = next(iter(r["forward_cost_s"].values()))
    curve = markdown_table(["new tokens n", *map(str, sizes)], rows)
    m = r["machine"]
    return (f"# Engine: cycle overhead and ceiling\n\nTarget {r['target']} ({r['dtype']}), {len(r['prompts'])} "
            f"generic prompts, up to {r['max_new_tokens']} new tokens, greedy; tree {r['tree']}, untrained GRIFFIN "
            f"head with a {r['draft_vocab'] or 'full'} draft vocabulary. Every output equals transformers' "
            f"`generate`.\n\n## Cost of one step\n\n{costs}\n## Ceiling: oracle drafts\n\n{oracle}\n"
            f"## Target forward cost by number of new tokens (256 cached)\n\n{curve}\nCommand: `{r['command']}`\n\n"
            f"Machine: {machine_text(m)}.\n")


if __name__ == "__main__":
    sys.exit(run_cli(main, (RuntimeError,)))
