"""Interactive chat with speculative generation, streamed token by token.

    python -m inference.chat                      # embedded SmolLM2 with its shipped head
    python -m inference.chat --draft heads/mine --temperature 0.7

Type a message and press Enter; an empty line or Ctrl-D quits, /reset starts a new conversation.
"""

from __future__ import annotations

import argparse
import sys

from griffin import GenerationStats, SpecGenerator
from griffin.target import EMBEDDED_TARGET
from training.cli import run_cli


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m inference.chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--draft", default=None)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="target dtype (default: fp32 on CPU, bf16 on CUDA)")
    args = p.parse_args(argv)
    gen = SpecGenerator.from_pretrained(args.target, args.draft, device=args.device, dtype=args.dtype)
    history = [{"role": "system", "content": args.system}] if args.system else []
    start = list(history)
    while True:
        try:
            line = input("\nyou> ").strip()
        except EOFError:
            break
        if not line:
            break
        if line == "/reset":
            history = list(start)
            continue
        history.append({"role": "user", "content": line})
        stats = GenerationStats()
        print("assistant> ", end="", flush=True)
        pieces = []
        for piece in gen.stream(history, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, stats=stats):
            pieces.append(piece)
            print(piece, end="", flush=True)
        history.append({"role": "assistant", "content": "".join(pieces)})
        print(f"\n[{stats.new_tokens} tokens, tau {stats.tau:.2f}, {stats.new_tokens / stats.wall_s:.1f} tokens/s]")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
