"""Regenerate the assistant answers of a chat dataset with the target itself (self-distillation data).

A draft head is judged on the target's own outputs, so training on answers the target generated (instead of another
model's) matches the contexts it will see. Takes the first user turn of each usable conversation, answers it with the
target (greedy by default) and writes ShareGPT-format JSON Lines that ``training.build_features --data`` reads::

    python -m training.regenerate --out data/regen --max-samples 6000 --dtype bf16
    python -m training.regenerate --out data/regen --parts 8:16 --dtype bf16     # only parts 8..15 (records 2048..)
    python -m training.regenerate --out data/regen --engine plain                # our batched plain loop
    python -m training.regenerate --out data/regen --engine speculative          # our engine with the shipped head

Work is written in parts of ``--part-size`` source records (part i answers records [i*S, (i+1)*S); each renamed
into place when complete, after ``part-XXXXX.json``, its seconds, tokens and engine); a rerun resumes. The merged file
is ``OUT/conversations.jsonl`` (not written with ``--parts``).
``--engine generate`` answers ``--batch-size`` prompts per transformers ``generate`` call (left-padded, optionally with
a static KV cache, every row padded to the batch's longest answer); ``--engine plain`` through our batched plain
loop (:func:`griffin.batch.decode_rows`: preallocated KV, each prompt prefilled alone, a finished row leaves the
batch); ``--engine speculative`` per batched :class:`griffin.SpecGenerator` call (greedy only), whose tree the tuner
sizes for the batch, down to that plain loop where no tree pays (``--total-tokens``, ``--retune``, ``--lookup``). In
fp32, greedy rows of our engines are each the tokens of ``generate`` on that prompt alone; in bf16 any engine's rows
depend on their batch (bf16 sums in another order). The log ends with the generation throughput in new tokens/s
(``benchmarks/results/pipeline-throughput.md`` compares the settings on one machine).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from itertools import islice
from pathlib import Path

from griffin.chat_template import prompt_ids, render, set_chat_template
from griffin.cli import add_tree_arguments, run_cli
from griffin.constants import EMBEDDED_TARGET
from griffin.hub import model_argument
from griffin.io import atomic_write, atomic_write_text

from .data import DEFAULT_DATA, BadConversation, DataError, add_max_bad_lines, iter_records, to_messages

log = logging.getLogger("regenerate")
MERGED = "conversations.jsonl"


def part_file(out: Path, part: int) -> Path:
    """The file of one part (``--part-size`` records) of the answers under ``out``."""
    return out / f"part-{part:05d}.jsonl"


def part_cost_file(out: Path, part: int) -> Path:
    """What answering one part cost (``seconds`` of wall time, ``prompts``, ``new_tokens``), written just before the
    part itself, so that the time of answers made by several runs or machines adds up exactly."""
    return out / f"part-{part:05d}.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.regenerate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET, type=model_argument("target"))
    p.add_argument("--data", default=DEFAULT_DATA, help="source conversations (ShareGPT format)")
    add_max_bad_lines(p)
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
    p.add_argument("--parts", default=None, help="START:END: answer only parts START..END-1")
    p.add_argument("--engine", default="generate", choices=["generate", "plain", "speculative"])
    p.add_argument("--cache", default="dynamic", choices=["dynamic", "static"],
                   help="KV cache of transformers generate (--engine generate)")
    p.add_argument("--draft", default=None, type=model_argument("draft head"),
                   help="head of --engine speculative (default: the shipped one)")
    add_tree_arguments(p)
    args = p.parse_args(argv)
    try:
        start, end = (args.parts or "0:").split(":")
        args.part_range = (int(start or 0), int(end) if end else None)
        assert args.part_range[0] >= 0 and (args.part_range[1] is None or args.part_range[1] > args.part_range[0])
    except (ValueError, AssertionError):
        p.error("--parts must look like START:END with 0 <= START < END")
    if args.engine == "speculative" and args.temperature > 0:
        p.error("--engine speculative regenerates greedily only (--temperature 0)")
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


def even_batches(items: list[int], most: int) -> list[list[int]]:
    """``items`` in order, in the fewest batches of at most ``most``, whose sizes differ by one at most (the batched
    engine tunes its tree once per batch size on a machine: a part's batches then take one or two sizes)."""
    count = -(-len(items) // most)
    size, extra = divmod(len(items), count) if count else (0, 0)
    cuts = [k * size + min(k, extra) for k in range(count + 1)]
    return [items[cuts[k] : cuts[k + 1]] for k in range(count)]


def answer(model, tokenizer, prompts: list[list[dict]], args, generator_seed: int) -> tuple[list[str], int]:
    """-> the answers and the number of tokens generated (each up to and including its end-of-sequence token)."""
    import torch

    texts = [render(tokenizer, m, add_generation_prompt=True) for m in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    torch.manual_seed(generator_seed)
    sample = args.temperature > 0
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=sample,
                             temperature=args.temperature if sample else None, top_p=None, top_k=None,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             cache_implementation="static" if args.cache == "static" else None)
    new = out[:, enc["input_ids"].shape[1]:]
    ended = (new == tokenizer.eos_token_id).int()
    lengths = torch.where(ended.any(1), ended.argmax(1) + 1, new.shape[1])
    return tokenizer.batch_decode(new, skip_special_tokens=True), int(lengths.sum())


def answer_speculative(gen, rows: list[list[int]], args) -> tuple[list[str], int]:
    out = gen.generate(rows, max_new_tokens=args.max_new_tokens)
    return out.texts, sum(len(t) for t in out.tokens)


def answer_plain(backend, tokenizer, rows: list[list[int]], args, generator_seed: int) -> tuple[list[str], int]:
    import torch

    from griffin.batch import decode_rows
    from griffin.decode import GenerationStats
    from griffin.family import window_crossed
    from griffin.generator import token_budget
    from griffin.sampling import SamplingConfig

    budgets = [token_budget(backend.model, len(r), args.max_new_tokens) for r in rows]  # as the engine's rows
    if window_crossed(backend.model.config, max(len(r) + n for r, n in zip(rows, budgets, strict=True)) + 1):
        raise ValueError("the batched plain loop does not batch this target's sliding-window layers yet: regenerate "
                         "with --engine generate")
    generator = None
    if args.temperature > 0:
        generator = torch.Generator(device=backend.device).manual_seed(generator_seed)
    eos = torch.tensor([tokenizer.eos_token_id], device=backend.device)
    with torch.inference_mode():
        tokens = decode_rows(backend, None, [torch.tensor(r, device=backend.device) for r in rows], budgets,
                             SamplingConfig(float(args.temperature)), eos, generator, GenerationStats())
    return tokenizer.batch_decode(tokens, skip_special_tokens=True), sum(len(t) for t in tokens)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from griffin.progress import progress
    from griffin.target import load_target

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_target(args.target, dtype=args.dtype)
    set_chat_template(tokenizer, args.chat_template)
    tokenizer.padding_side = "left"
    if args.engine == "speculative":
        from griffin import SpecGenerator

        gen = SpecGenerator.from_pretrained(model, args.draft, tokenizer=tokenizer, total_tokens=args.total_tokens,
                                            retune=args.retune, lookup=args.lookup)

        def respond(batch: list[list[dict]], rows: list[list[int]], seed: int) -> tuple[list[str], int]:
            return answer_speculative(gen, rows, args)
    elif args.engine == "plain":
        from griffin.backend import TargetBackend
        from griffin.family import check_target

        check_target(model)  # refuses, with the reason, a target whose cached passes would not give its own logits
        backend = TargetBackend(model)

        def respond(batch: list[list[dict]], rows: list[list[int]], seed: int) -> tuple[list[str], int]:
            return answer_plain(backend, tokenizer, rows, args, seed)
    else:
        def respond(batch: list[list[dict]], rows: list[list[int]], seed: int) -> tuple[list[str], int]:
            return answer(model, tokenizer, batch, args, seed)
    first, last = args.part_range
    records = iter_records(args.data, args.max_bad_lines)
    stop = args.max_samples if last is None else min(last * args.part_size, args.max_samples or last * args.part_size)
    if stop is not None:
        records = islice(records, stop)
    bar = progress(total=stop, unit="rec", desc="regenerate", dynamic_ncols=True)
    part = 0
    new_tokens, seconds, answered = 0, 0.0, 0
    while chunk := list(islice(records, args.part_size)):
        path = part_file(out, part)
        if part >= first and part % args.num_shards == args.shard_index and not path.is_file():
            part_start, part_tokens = time.perf_counter(), new_tokens
            prompts, tokens, ids = [], [], []
            for j, record in enumerate(chunk):
                try:
                    messages = first_turn(record)
                except BadConversation:
                    continue
                encoded = prompt_ids(tokenizer, messages)
                if len(encoded) <= args.max_prompt_len:
                    prompts.append(messages)
                    tokens.append(encoded)
                    ids.append(str(record.get("id", f"{part}-{j}")))
            order = sorted(range(len(prompts)), key=lambda k: len(prompts[k][-1]["content"]))
            lines = {}
            for b, batch in enumerate(even_batches(order, args.batch_size)):
                t0 = time.perf_counter()
                answers, count = respond([prompts[k] for k in batch], [tokens[k] for k in batch],
                                         args.seed + part * 1000 + b)
                seconds += time.perf_counter() - t0
                new_tokens += count
                answered += len(batch)
                for k, text in zip(batch, answers):
                    turns = [{"from": "system" if m["role"] == "system" else "human", "value": m["content"]}
                             for m in prompts[k]]
                    lines[k] = json.dumps({"id": ids[k], "conversations": turns + [{"from": "gpt", "value": text}]})
                bar.set_postfix(new_tokens=new_tokens, tok_s=f"{new_tokens / seconds:.0f}")
            body = "".join(lines[k] + "\n" for k in sorted(lines))
            cost = {"seconds": round(time.perf_counter() - part_start, 1), "prompts": len(prompts),
                    "new_tokens": new_tokens - part_tokens, "engine": args.engine}
            atomic_write_text(part_cost_file(out, part), json.dumps(cost) + "\n")
            atomic_write_text(path, body)
            bar.update(len(chunk))
        else:  # another part range, another process's, or answered before a resume
            bar.skip(len(chunk))
        part += 1
    bar.close()
    if new_tokens:
        log.info("answered %d prompts, generated %d new tokens in %.1f s: generation throughput %.1f tokens/s",
                 answered, new_tokens, seconds, new_tokens / seconds)
    if args.parts is not None:
        return 0
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
