"""Batched generation with the tree adapting per batch against the same generator with its batch tree fixed.

    OMP_NUM_THREADS=1 python benchmarks/results/batch-adapt/study.py
    OMP_NUM_THREADS=1 python benchmarks/results/batch-adapt/study.py --rows 4 --turn 1 --prompts 32
    OMP_NUM_THREADS=1 python benchmarks/results/batch-adapt/study.py --rows 4 --turn 1 --prompts 32 --adapt-rows 4

MT-Bench second turns (the first 16 questions, after our batched plain loop's greedy first answer of at most 256
tokens), batch 2, 64 new tokens, greedy, fp32 and bf16, each row's lookup chain of 10. One generator, reading the
tuned records, with ``adapt`` on (each batch adapts its shape, ``ShapePolicy``) and off (the batch size's tuned tree
for the whole call); one instance, so that both ways share its weights in memory. Each group of prompts is generated
both ways in turn, the order alternating from group to group; in fp32 the outputs must be identical (in bf16 a pass
over other tokens may round a near-tie apart, so there they are counted). Where adaptation is off at a batch size,
both ways run the same code: the row measures the noise. Writes ``study.json`` and ``study.md`` beside this file
(other settings: ``study-<rows>-turn<turn>.*``). ``--adapt-rows N`` lets batches of up to N rows adapt
(:data:`griffin.adapt.ADAPT_ROWS` for this run; files ``...-adapt<N>.*``), to measure a rule before it is made.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import griffin.generator
from griffin import SpecGenerator
from griffin.batch import decode_rows
from griffin.decode import GenerationStats
from griffin.report import machine_info, machine_text
from griffin.sampling import SamplingConfig
from inference.questions import load_questions

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=2)
parser.add_argument("--turn", type=int, choices=[1, 2], default=2)
parser.add_argument("--prompts", type=int, default=16)
parser.add_argument("--dtypes", default="fp32,bf16")
parser.add_argument("--adapt-rows", type=int, default=None, help="largest batch that adapts (default: the library's)")
ARGS = parser.parse_args()
if ARGS.adapt_rows is not None:
    griffin.generator.ADAPT_ROWS = ARGS.adapt_rows
ROWS, NEW, PROMPTS, ANSWER, TURN = ARGS.rows, 64, ARGS.prompts, 256, ARGS.turn
HERE = Path(__file__).parent
STEM = "study" if (ROWS, TURN) == (2, 2) else f"study-{ROWS}-turn{TURN}"
STEM += "" if ARGS.adapt_rows is None else f"-adapt{ARGS.adapt_rows}"


def second_turns(gen: SpecGenerator) -> list[torch.Tensor]:
    questions = load_questions("mt_bench", PROMPTS)
    chats = [[{"role": "user", "content": q["turns"][0]}] for q in questions]
    firsts = [gen.encode(c) for c in chats]
    if TURN == 1:
        return firsts
    answers = decode_rows(gen.backend, None, firsts, [ANSWER] * PROMPTS, SamplingConfig(), gen.eos_ids(None), None,
                          GenerationStats())
    return [gen.encode(c + [{"role": "assistant", "content": gen.tokenizer.decode(a, skip_special_tokens=True)},
                            {"role": "user", "content": q["turns"][1]}])
            for c, a, q in zip(chats, answers, questions, strict=True)]


def run(dtype: str) -> dict:
    gen = SpecGenerator.from_pretrained("smollm2-135m-instruct", dtype=dtype, lookup=10)
    prompts = second_turns(gen)
    methods = {"adaptive": True, "fixed": False}
    for adapt in methods.values():
        gen.adapt = adapt
        gen.generate(prompts[:ROWS], max_new_tokens=8)  # warm-up (and the batch tree, read from the tuning cache)
    ratios, seconds, tokens, same = [], {m: 0.0 for m in methods}, 0, 0
    for g in range(0, PROMPTS, ROWS):
        group, took, outs = prompts[g : g + ROWS], {}, {}
        order = list(methods) if (g // ROWS) % 2 == 0 else list(methods)[::-1]
        for name in order:
            gen.adapt = methods[name]
            t0 = time.perf_counter()
            outs[name] = gen.generate(group, max_new_tokens=NEW)
            took[name] = time.perf_counter() - t0
            seconds[name] += took[name]
        same += outs["adaptive"].tokens == outs["fixed"].tokens
        if dtype == "fp32" and outs["adaptive"].tokens != outs["fixed"].tokens:  # bf16 may round near-ties apart
            raise RuntimeError(f"group {g // ROWS}: the adaptive batch wrote other tokens than the fixed one in fp32")
        tokens += sum(len(t) for t in outs["adaptive"].tokens)
        ratios.append(took["fixed"] / took["adaptive"])
    gen.adapt = True
    return {"dtype": dtype, "batch_tree": list(gen.batch_tree(ROWS)),
            "shapes": [s.name for s in gen.batch_shapes(ROWS)], "tokens": tokens, "seconds": seconds,
            "speedup_adaptive_over_fixed": seconds["fixed"] / seconds["adaptive"],
            "per_group": ratios, "mean": statistics.mean(ratios), "identical_groups": same,
            "se": statistics.stdev(ratios) / len(ratios) ** 0.5}


runs = [run(dtype) for dtype in ARGS.dtypes.split(",")]
argv = "" if (ROWS, TURN) == (2, 2) else f" --rows {ROWS} --turn {TURN}"
argv += "" if PROMPTS == 16 else f" --prompts {PROMPTS}"
argv += "" if ARGS.dtypes == "fp32,bf16" else f" --dtypes {ARGS.dtypes}"
argv += "" if ARGS.adapt_rows is None else f" --adapt-rows {ARGS.adapt_rows}"
result = {"rows": ROWS, "turn": TURN, "new_tokens": NEW, "prompts": PROMPTS, "answer_tokens": ANSWER, "runs": runs,
          "machine": machine_info(),
          "command": f"OMP_NUM_THREADS=1 python benchmarks/results/batch-adapt/study.py{argv}"}
(HERE / f"{STEM}.json").write_text(json.dumps(result, indent=1) + "\n")
lines = [f"# Batch {ROWS}: the tree adapting per batch against the batch's tuned tree, fixed\n",
         (f"MT-Bench second turns ({PROMPTS}, after a greedy first answer of at most {ANSWER} tokens)" if TURN == 2
          else f"MT-Bench first turns ({PROMPTS})") + f", {NEW} new tokens, "
         "greedy, each row's lookup chain of 10. Identical: groups where both wrote the same tokens (required in fp32).\n",
         "| dtype | tuned batch tree (depth, nodes) | shapes adapted among | adaptive / fixed speed | per group | identical |",
         "| --- | --- | --- | --- | --- | --- |"]
for r in runs:
    lines.append(f"| {r['dtype']} | {tuple(r['batch_tree'])} | {', '.join(r['shapes'])} | "
                 f"{r['speedup_adaptive_over_fixed']:.2f}x | {r['mean']:.2f} ± {r['se']:.2f} ({len(r['per_group'])}) | "
                 f"{r['identical_groups']}/{len(r['per_group'])} |")
lines += ["", f"Command: `{result['command']}`", "", machine_text(result["machine"]), ""]
(HERE / f"{STEM}.md").write_text("\n".join(lines))
print("\n".join(lines))
