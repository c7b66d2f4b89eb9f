"""Regenerate the assistant answers of a chat dataset with the target itself (self-distillation data).

A draft head is judged on the target's own outputs, so training on answers the target generated (instead of another
model's) matches the contexts it will see. Takes the first user turn of each usable conversation, answers it with the
target (greedy by default) and writes ShareGPT-format JSON Lines that ``training.build_features --data`` reads::

    python -m training.regenerate --out data/regen --max-samples 6000 --dtype bf16

Work is written in parts of ``--part-size`` prompts (each renamed into place when complete); a rerun resumes. The
merged file is ``OUT/conversations.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from itertools import islice
from pathlib import Path

from griffin.chat import render, set_chat_template
from griffin.constants import EMBEDDED_TARGET
from griffin.io import atomic_write, atomic_write_text

from .cli import run_cli
from .data import DEFAULT_DATA, BadConversation, DataError, iter_records, to_messages

log = logging.getLogger("regenerate")
MERGED = "conversations.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.regenerate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--data", default=DEFAULT_DATA, help="source conversations (ShareGPT format)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--max-samples", type=int, default=None, help="use the first N source records")
    p.add_argument("--max-prompt-len", type=int, default=384, help="skip prompts longer than this many tokens")
    p.add_argument("--max-new-tokens", type=int, default=400)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--part-size", type=int, default=256, help="source records per output part")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default=None)
    p.add_argument("--shard", default="0/1", help="i/n: this process answers parts i, i+n, ... (run n processes)")
    args = p.parse_args(argv)
    try:
        args.shard_index, args.num_shards = (int(x) for x in args.shard.split("/"))
        assert 0 <= args.shard_index < args.num_shards
    except (ValueError, AssertionError):
        p.error("--shard must look like i/n with 0 <= i < n")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    return args


def first_turn(record) -> list[dict[str, str]]:
    messages = to_messages(record)
    start = 1 if messages[0]["role"] == "system" else 0
    return messages[: start + 1]


def answer(model, tokenizer, prompts: list[list[dict]], args, generator_seed: int) -> list[str]:
    import torch

    texts = [render(tokenizer, m, add_generation_prompt=True) for m in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    torch.manual_seed(generator_seed)
    sample = args.temperature > 0
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=sample,
                             temperature=args.temperature if sample else None, top_p=None, top_k=None,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm.auto import tqdm

    from griffin.target import load_target

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_target(args.target, dtype=args.dtype)
    set_chat_template(tokenizer, args.chat_template)
    tokenizer.padding_side = "left"
    records = iter_records(args.data)
    if args.max_samples is not None:
        records = islice(records, args.max_samples)
    bar = tqdm(total=args.max_samples, unit="rec", desc="regenerate", dynamic_ncols=True)
    part = 0
    new_tokens = 0
    while chunk := list(islice(records, args.part_size)):
        path = out / f"part-{part:05d}.jsonl"
        if part % args.num_shards == args.shard_index and not path.is_file():
            prompts, ids = [], []
            for j, record in enumerate(chunk):
                try:
                    messages = first_turn(record)
                except BadConversation:
                    continue
                n = len(tokenizer(render(tokenizer, messages, True), add_special_tokens=False)["input_ids"])
                if n <= args.max_prompt_len:
                    prompts.append(messages)
                    ids.append(str(record.get("id", f"{part}-{j}")))
            order = sorted(range(len(prompts)), key=lambda k: len(prompts[k][-1]["content"]))
            lines = {}
            for b in range(0, len(order), args.batch_size):
                batch = order[b : b + args.batch_size]
                answers = answer(model, tokenizer, [prompts[k] for k in batch], args, args.seed + part * 1000 + b)
                for k, text in zip(batch, answers):
                    turns = [{"from": "system" if m["role"] == "system" else "human", "value": m["content"]}
                             for m in prompts[k]]
                    lines[k] = json.dumps({"id": ids[k], "conversations": turns + [{"from": "gpt", "value": text}]})
                    new_tokens += len(tokenizer(text, add_special_tokens=False)["input_ids"])
                bar.set_postfix(new_tokens=new_tokens)
            body = "".join(lines[k] + "\n" for k in sorted(lines))
            atomic_write_text(path, body)
        bar.update(len(chunk))
        part += 1
    bar.close()
    parts = sorted(out.glob("part-*.jsonl"))
    if len(parts) < part:
        print(f"{part - len(parts)} parts are still being answered by other processes; the last one to finish "
              f"writes {out / MERGED}")
        return 0
    atomic_write(out / MERGED, lambda p: p.write_text("".join(x.read_text() for x in parts)))
    count = sum(1 for _ in open(out / MERGED))
    print(f"{out / MERGED}: {count} conversations answered by {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, (DataError,)))
