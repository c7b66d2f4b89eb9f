"""Speculative generation on a few prompts, side by side with the fastest plain decoding.

    python -m inference.demo                      # the embedded SmolLM2 target with its shipped GRIFFIN head
    python -m inference.demo --draft heads/mine --prompt "Tell me a joke."
    python -m inference.demo --target meta-llama/Llama-3.1-8B-Instruct --draft org/llama-3.1-8b-head   # Hub ids
    python -m inference.demo --total-tokens 8     # a fixed tree: no tuning

Prints in one line the configuration it runs and why (what the tuner measured on this machine), then each answer, the
acceptance length (tokens per target forward pass), tokens/s of speculative generation and of both plain decodings
(transformers' ``generate`` and griffin's own loop), the speedup over the faster of the two, and whether the output is
identical to ``generate``'s. The first run on a machine tunes the tree, with and without a prompt-lookup chain of
10 tokens (about a minute each, cached), and keeps the one that measured faster against the plain loop; ``--lookup N``
fixes the chain.
"""

from __future__ import annotations

import argparse
import sys
import time

from griffin.cli import add_device_arguments, add_tree_arguments, nonnegative_float, positive_int, run_cli
from griffin.constants import EMBEDDED_TARGET
from griffin.hub import model_argument

LOOKUP = 10  # the chain tried beside none when --lookup is not given
PROMPTS = [
    "Write a short poem about the sea.",
    "Give me three tips for a good night's sleep.",
    "Explain what a hash table is in two sentences.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET, type=model_argument("target"),
                   help="target Hub id, name or folder (default: %(default)s)")
    p.add_argument("--draft", default=None, type=model_argument("draft head"),
                   help="head Hub id or folder (default: the head shipped for the target)")
    p.add_argument("--prompt", action="append", help="a user message (repeatable; default: three examples)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0 = greedy")
    add_device_arguments(p)
    add_tree_arguments(p)
    p.set_defaults(lookup=None)  # the demo's default: the chain (or none) that measured faster here
    return p.parse_args(argv)


def measured_gain(record: dict | None) -> float:
    """The tuned choice's median speedup over the plain loop in the tuner's check (1 for the plain loop itself)."""
    record = record or {}
    key = f"{record.get('depth')}x{record.get('total_tokens')}"
    return (record.get("measured_speedup_over_plain") or {}).get(key, 1.0)


def choose_lookup(gen, temperature: float, retune: bool) -> None:
    """Tune the tree for ``temperature`` with no chain and with a chain of :data:`LOOKUP` tokens (each cached) and
    keep the one whose choice measured faster against the plain loop."""
    gains = {}
    for lookup in (0, LOOKUP):
        gen.lookup = lookup
        gen.follow_temperature(retune)
        gen.tune_for(temperature)
        gains[lookup] = measured_gain(gen.tuning(temperature))
    gen.lookup = max(gains, key=gains.get)
    gen.follow_temperature()
    gen.tune_for(temperature)


def configuration_line(gen, temperature: float) -> str:
    """What the demo runs and why, in one line."""
    from griffin.autotune import describe

    record = gen.tuning(temperature)
    if record is None:
        what = "no tree" if gen.total_tokens == 0 else f"a fixed tree of {gen.total_tokens} nodes, depth {gen.depth}"
        return f"configuration: {what}{f' + lookup {gen.lookup}' if gen.lookup else ''} (set on the command line)"
    adapt = "; adapted per request from there" if gen.adapting else ""
    return f"configuration (tuned on this machine): {describe(record)}{adapt}. Why: {record['reason']}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from griffin import SpecGenerator
    from griffin.plain import plain_generate
    from griffin.sampling import SamplingConfig

    gen = SpecGenerator.from_pretrained(args.target, args.draft, total_tokens=args.total_tokens, retune=args.retune,
                                        lookup=args.lookup or 0, device=args.device, dtype=args.dtype)
    if args.lookup is None and args.total_tokens == "auto":
        choose_lookup(gen, args.temperature, args.retune)
    else:
        gen.tune_for(args.temperature)
    print(configuration_line(gen, args.temperature))
    eos = gen.eos_ids(None)
    sampling = SamplingConfig(args.temperature)
    hf_kwargs = dict(do_sample=args.temperature > 0, temperature=args.temperature or None, top_p=None, top_k=None,
                     eos_token_id=eos.tolist(), pad_token_id=gen.tokenizer.pad_token_id)

    def timed(run) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = run()
        return out, time.perf_counter() - t0

    def methods(ids: torch.Tensor, budget: int, seed: int) -> dict:
        torch.manual_seed(seed)
        spec, spec_s = timed(lambda: gen.generate(ids, max_new_tokens=budget, temperature=args.temperature, seed=seed))
        torch.manual_seed(seed)
        hf, hf_s = timed(lambda: gen.target.generate(ids[None], max_new_tokens=budget, **hf_kwargs)[0, len(ids):])
        loop, loop_s = timed(lambda: plain_generate(gen.target, ids, budget, sampling, eos,
                                                    torch.Generator().manual_seed(seed)))
        return {"spec": (spec, spec_s), "generate": (hf, hf_s), "own loop": (loop, loop_s)}

    methods(gen.encode([{"role": "user", "content": "Hi"}]), 8, 0)  # warm-up
    totals = {"spec": 0.0, "generate": 0.0, "own loop": 0.0}
    tokens = {"spec": 0, "generate": 0, "own loop": 0}
    for i, prompt in enumerate(args.prompt or PROMPTS):
        ids = gen.encode([{"role": "user", "content": prompt}])
        runs = methods(ids, args.max_new_tokens, i)
        result = runs["spec"][0]
        for name, (out, seconds) in runs.items():
            totals[name] += seconds
            tokens[name] += result.stats.new_tokens if name == "spec" else len(out)
        new = result.sequences[0, len(ids):]
        same = "identical to" if torch.equal(new, runs["generate"][0]) else (
            "sampled independently of" if args.temperature > 0 else "DIFFERENT FROM")
        rate = {name: (result.stats.new_tokens if name == "spec" else len(out)) / seconds
                for name, (out, seconds) in runs.items()}
        print(f"\n### {prompt}\n{result.text}\n")
        print(f"tau {result.stats.tau:.2f} tokens/pass · {rate['spec']:.1f} tokens/s · plain: generate "
              f"{rate['generate']:.1f}, own loop {rate['own loop']:.1f} tokens/s · output {same} transformers' "
              "generate")
    baseline = min(("generate", "own loop"), key=lambda name: totals[name] / tokens[name])
    speedup = (totals[baseline] / tokens[baseline]) / (totals["spec"] / tokens["spec"])
    print(f"\nspeedup over the fastest plain decoding ({baseline}, {tokens[baseline] / totals[baseline]:.1f} "
          f"tokens/s): {speedup:.2f}x ({tokens['spec'] / totals['spec']:.1f} tokens/s; tree of {gen.total_tokens} "
          f"nodes, depth {gen.depth}{f', lookup {gen.lookup}' if gen.lookup else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, interrupted="interrupted"))
