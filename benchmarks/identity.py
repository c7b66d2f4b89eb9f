"""Where greedy outputs stop being identical to transformers' ``generate``, and why.

    python -m benchmarks.identity --dtype bf16 --limit 20
    python -m benchmarks.identity --dtype fp32 --limit 20 --draft checkpoints/smollm2-135m-instruct-eagle

Greedy decoding is a chain of argmaxes. A speculative engine verifies several tokens in one target forward, so its
matrix products sum in another order than a one-token step does; in fp32 that moves logits by about 1e-6 and never
changes an argmax here, in bf16 a logit has 8 significant bits and two candidates within one rounding step of each
other are common. Whether a divergence is that rounding or a bug in the engine shows in two figures:

- **the controls**: the same plain greedy loop with each matrix-product kernel (``F.linear``; weight-major; the row
  padded to two rows, the product a verification pass takes), and ``generate`` itself with the prompt in a batch of
  two (left-padded beside the next question, as a server batches requests): mathematically one computation, so
  every divergence among them is rounding;
- **the margin at the first divergence**: ``generate``'s own logit of its token minus its logit of the token the
  other method chose there, in units of the rounding step (ulp) of the dtype at that logit. A bug shows up as
  divergences at large margins; rounding as margins of a few ulp.

Writes ``benchmarks/results/identity-<dtype>.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from griffin.cli import run_cli, tree_size
from griffin.constants import EMBEDDED_TARGET

KERNELS = ("linear", "weight-major", "pad")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.identity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--draft", default=None, help="head Hub id or folder (default: the head shipped for the target)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"], help="target dtype (default: %(default)s)")
    p.add_argument("--bench", default="mt_bench", choices=["mt_bench", "humaneval", "gsm8k"])
    p.add_argument("--limit", type=int, default=20, help="first turns of the first N questions")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--total-tokens", type=tree_size, default="auto", help="draft tree size (as inference.speed)")
    p.add_argument("--out-dir", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.limit < 1 or args.max_new_tokens < 1:
        p.error("--limit and --max-new-tokens must be at least 1")
    args.argv = argv
    return args


if __name__ == "__main__":  # --help and usage errors answer here, before torch and transformers load
    parse_args()

import torch
from tqdm.auto import tqdm

from griffin import SpecGenerator
from griffin.chat_template import prompt_ids
from griffin.plain import plain_generate
from griffin.report import command_line, machine_info, machine_text, markdown_table, write_benchmark
from griffin.sampling import SamplingConfig
from griffin.target import load_target
from inference.questions import load_questions


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s representable numbers at ``value``."""
    x = torch.tensor(abs(value), dtype=dtype)
    return float(torch.nextafter(x, torch.tensor(float("inf"), dtype=dtype)) - x)


def first_divergence(reference: list[int], other: list[int], logits: torch.Tensor, dtype: torch.dtype) -> dict | None:
    """None when identical; else the position, and ``generate``'s logit margin there (logits [n, V] of its steps)."""
    if other == reference:
        return None
    at = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    if at >= min(len(reference), len(other)):  # one stopped earlier: the length differs, no token to compare
        return {"position": at, "margin": None, "margin_ulp": None}
    row = logits[at].float()
    margin = float(row[reference[at]] - row[other[at]])
    return {"position": at, "margin": margin, "margin_ulp": margin / ulp(float(row[reference[at]]), dtype)}


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict:
    target, tokenizer = load_target(args.target, dtype=args.dtype)
    gen = SpecGenerator.from_pretrained(target, args.draft, tokenizer=tokenizer, total_tokens=args.total_tokens)
    eos = gen.eos_ids(None)
    dtype = next(target.parameters()).dtype
    methods = ["generate, batch of 2"] + [f"plain {k}" for k in KERNELS] + ["speculative"]
    divergences: dict[str, list] = {m: [] for m in methods}
    questions = load_questions(args.bench)
    hf = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos.tolist(),
              pad_token_id=tokenizer.pad_token_id)
    for i, question in enumerate(tqdm(questions[: args.limit], desc="identity", unit="q")):
        ids, beside = (torch.tensor(prompt_ids(tokenizer, [{"role": "user", "content": q["turns"][0]}]))
                       for q in (question, questions[(i + 1) % len(questions)]))
        out = target.generate(ids[None], output_logits=True, return_dict_in_generate=True, **hf)
        reference = out.sequences[0, len(ids):].tolist()
        logits = torch.cat(out.logits)  # [n, V]: generate's logits at each of its steps
        for method in methods:
            if method == "speculative":
                tokens = gen.generate(ids, max_new_tokens=args.max_new_tokens).sequences[0, len(ids):].tolist()
            elif method == "generate, batch of 2":
                batch = tokenizer.pad({"input_ids": [ids.tolist(), beside.tolist()]}, padding_side="left",
                                      return_tensors="pt")
                width = batch["input_ids"].shape[1]
                row0 = target.generate(**batch, **hf)[0, width:].tolist()
                stop = next((j + 1 for j, t in enumerate(row0) if t in eos.tolist()), len(row0))
                tokens = row0[:stop]  # the row's own answer, without the padding after its EOS
            else:
                tokens = plain_generate(target, ids, args.max_new_tokens, SamplingConfig(), eos,
                                        one_row=method.split()[1]).tolist()
            found = first_divergence(reference, tokens, logits, dtype)
            divergences[method].append(None if found is None else {"question_id": question["question_id"], **found})
    rows = {}
    for method, found in divergences.items():
        hits = [d for d in found if d is not None]
        margins = sorted(d["margin_ulp"] for d in hits if d["margin_ulp"] is not None)
        rows[method] = {"identical_fraction": 1 - len(hits) / len(found), "diverged": len(hits),
                        "median_margin_ulp": margins[len(margins) // 2] if margins else None,
                        "max_margin_ulp": margins[-1] if margins else None, "divergences": hits}
    tree = {"depth": gen.depth, "top_k": gen.top_k, "total_tokens": gen.total_tokens}
    draft = Path(args.draft or gen.draft_path or "head").name
    return {"target": args.target, "dtype": args.dtype, "bench": args.bench, "prompts": args.limit,
            "max_new_tokens": args.max_new_tokens, "tree": tree, "draft": draft,
            "methods": rows, "machine": machine_info(), "command": command_line("benchmarks.identity", args.argv)}


def report(result: dict) -> str:
    rows = [[m, r["identical_fraction"], r["diverged"], "-" if r["median_margin_ulp"] is None else
             f"{r['median_margin_ulp']:.1f}", "-" if r["max_margin_ulp"] is None else f"{r['max_margin_ulp']:.1f}"]
            for m, r in result["methods"].items()]
    m = result["machine"]
    return (f"# Greedy identity to transformers `generate` at {result['dtype']}\n\n"
            f"{result['prompts']} {result['bench']} first turns, up to {result['max_new_tokens']} new tokens, target "
            f"{result['target']} ({result['dtype']}); speculative: {result['draft']} with tree {result['tree']}. "
            "Plain rows: our greedy loop with each one-row kernel (the same computation summed in another order). "
            "Margin: at the first divergence, `generate`'s logit of its token minus its logit of the other "
            "method's token, in rounding steps (ulp) of the dtype at that logit.\n\n"
            + markdown_table(["method", "identical fraction", "prompts diverged", "median margin (ulp)",
                              "max margin (ulp)"], rows)
            + f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(m)}.\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    write_benchmark(Path(args.out_dir), f"identity-{args.dtype}", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
