"""Interactive chat with speculative generation, streamed token by token.

    python -m inference.chat                      # embedded SmolLM2 with its shipped head
    python -m inference.chat --draft heads/mine --temperature 0.7
    python -m inference.chat --resume ~/.cache/griffin/chats/chat-20260101-120000.json

Type a message and press Enter; an empty line or Ctrl-D quits, /reset starts a new conversation. Ctrl-C during a reply
stops that reply; Ctrl-C at the prompt quits. The conversation is saved after every reply (``--save``; by default
under the griffin cache) and the command to continue it is printed when you quit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from griffin.cli import (
    add_device_arguments,
    add_tree_arguments,
    nonnegative_float,
    positive_int,
    prepare_out,
    probability,
    run_cli,
)
from griffin.constants import EMBEDDED_TARGET
from griffin.hub import model_argument


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference.chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET, type=model_argument("target"),
                   help="target Hub id, name or folder (default: %(default)s)")
    p.add_argument("--draft", default=None, type=model_argument("draft head"),
                   help="head Hub id or folder (default: the head shipped for the target)")
    p.add_argument("--max-new-tokens", type=positive_int, default=512)
    p.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=probability, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (default: a fresh one)")
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--resume", default=None, help="continue a conversation saved by an earlier chat")
    p.add_argument("--save", default=None,
                   help="file the conversation is saved to after every reply (default: the --resume file, else "
                        "<griffin cache>/chats/chat-<date>-<time>.json)")
    add_device_arguments(p)
    add_tree_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from griffin import GenerationStats, SpecGenerator
    from griffin.chat_template import check_messages
    from griffin.io import atomic_write_json, read_json
    from griffin.target import cache_dir

    if args.resume:
        saved = read_json(args.resume, "saved conversation")
        history = check_messages(saved.get("messages") if isinstance(saved, dict) else saved)
    else:
        history = [{"role": "system", "content": args.system}] if args.system else []
    save = Path(args.save or args.resume or cache_dir() / "chats" / f"chat-{time.strftime('%Y%m%d-%H%M%S')}.json")
    try:  # before the model loads: a conversation that cannot be saved is known at once
        prepare_out(save.parent, "the folder of --save" if args.save else "the folder of --resume" if args.resume
                    else "the folder of saved chats")
    except ValueError as err:
        if args.save or args.resume:
            raise
        print(f"[not saving this conversation: {err}; pass --save FILE to save it]", file=sys.stderr)
        save = None
    gen = SpecGenerator.from_pretrained(args.target, args.draft, total_tokens=args.total_tokens, retune=args.retune,
                                        lookup=args.lookup, device=args.device, dtype=args.dtype)
    start = [m for m in history if m["role"] == "system"][:1]
    if args.resume:
        print(f"[continuing {save}: {sum(m['role'] == 'user' for m in history)} earlier messages]")

    def quit_(code: int) -> int:
        if save is not None and any(m["role"] == "assistant" for m in history):
            print(f"\n[conversation saved to {save}; continue it with: python -m inference.chat --resume {save}]")
        return code

    while True:
        try:
            line = input("\nyou> ").strip()
        except EOFError:
            return quit_(0)
        except KeyboardInterrupt:
            return quit_(130)
        if not line:
            return quit_(0)
        if line == "/reset":
            history = list(start)
            continue
        history.append({"role": "user", "content": line})
        stats = GenerationStats()
        print("assistant> ", end="", flush=True)
        pieces: list[str] = []
        try:
            for piece in gen.stream(history, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_p=args.top_p, seed=args.seed, stats=stats):
                pieces.append(piece)
                print(piece, end="", flush=True)
            speed = stats.new_tokens / stats.wall_s if stats.wall_s else 0.0
            print(f"\n[{stats.new_tokens} tokens, tau {stats.tau:.2f}, {speed:.1f} tokens/s]")
        except KeyboardInterrupt:
            print("\n[reply stopped; it stays in the conversation. Ctrl-C at the prompt quits]")
        history.append({"role": "assistant", "content": "".join(pieces)})
        if save is not None:
            atomic_write_json(save, {"target": args.target, "draft": args.draft, "messages": history})


if __name__ == "__main__":
    sys.exit(run_cli(main, interrupted="interrupted"))
