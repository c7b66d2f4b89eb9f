"""Speculative generation on a few prompts, side by side with plain generation.

    python -m inference.demo                      # the embedded SmolLM2 target with its shipped GRIFFIN head
    python -m inference.demo --draft heads/mine --prompt "Tell me a joke."

Prints each answer, the acceptance length (tokens per target forward pass), tokens/s, and the speedup over
transformers' ``generate`` on the same prompt, and checks that both wrote the same tokens.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from griffin import SpecGenerator
from griffin.target import EMBEDDED_TARGET
from training.cli import run_cli

PROMPTS = [
    "Write a short poem about the sea.",
    "Give me three tips for a good night's sleep.",
    "Explain what a hash table is in two sentences.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--draft", default=None, help="head folder (default: the head shipped for the target)")
    p.add_argument("--prompt", action="append", help="a user message (repeatable; default: three examples)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="target dtype (default: fp32 on CPU, bf16 on CUDA)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gen = SpecGenerator.from_pretrained(args.target, args.draft, device=args.device, dtype=args.dtype)
    sample = args.temperature > 0
    hf_kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=sample, temperature=args.temperature or None,
                     top_p=None, top_k=None)
    warm = gen.encode([{"role": "user", "content": "Hi"}])
    gen.generate(warm, max_new_tokens=8)
    gen.target.generate(warm[None], max_new_tokens=8)
    total_spec = total_plain = 0.0
    for i, prompt in enumerate(args.prompt or PROMPTS):
        ids = gen.encode([{"role": "user", "content": prompt}])
        t0 = time.perf_counter()
        result = gen.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=i)
        spec = time.perf_counter() - t0
        torch.manual_seed(i)
        t0 = time.perf_counter()
        with torch.inference_mode():
            plain = gen.target.generate(ids[None], **hf_kwargs)
        plain_s = time.perf_counter() - t0
        total_spec, total_plain = total_spec + spec, total_plain + plain_s
        stats = result.stats
        same = "identical to" if torch.equal(plain, result.sequences) else "differs from (sampling)"
        print(f"\n### {prompt}\n{result.text}\n")
        print(f"tau {stats.tau:.2f} tokens/pass · {stats.new_tokens / spec:.1f} tokens/s · plain generate "
              f"{(plain.shape[1] - ids.shape[0]) / plain_s:.1f} tokens/s · speedup {plain_s / spec:.2f}x · output "
              f"{same} transformers' generate")
    print(f"\noverall speedup over transformers' generate: {total_plain / total_spec:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
