"""What a batch's probes give by the n-grams their rows' contexts repeat: the evidence behind the probe gate.

    OMP_NUM_THREADS=1 python benchmarks/results/batch-adapt/gate.py

Batched generation as ``study.py`` runs it (greedy, 64 new tokens, each row's lookup chain of 10, ``adapt`` on), with
the probe gate turned off, so that every probe the policy asks for runs. Each probe (a tree cycle after plain steps,
or a batch's first cycle) is classed by what the rows' contexts repeated when it was drafted: every row its last
3-gram; every row its last 2-gram but not all their 3-gram; or some row neither. Per class: the tokens the slowest
row emitted (what sets a batch's cycles) and the mean over rows. Settings: where batches adapt on the Xeon (fp32
batch 2 and 4, bf16 batch 4), MT-Bench first and second turns. Writes ``gate.json`` and ``gate.md`` beside this file.
"""

import json
import statistics
from pathlib import Path

import torch

from griffin import SpecGenerator
from griffin.adapt import PLAIN, ShapePolicy
from griffin.batch import BatchPromptLookup, decode_rows
from griffin.decode import GenerationStats
from griffin.report import machine_info, machine_text
from griffin.sampling import SamplingConfig
from inference.questions import load_questions

SETTINGS = [("fp32", 2, 1, 80), ("fp32", 2, 2, 32), ("fp32", 4, 1, 80), ("fp32", 4, 2, 32), ("bf16", 4, 1, 80),
            ("bf16", 4, 2, 32)]  # dtype, batch, turn, prompts
NEW, ANSWER = 64, 256
HERE = Path(__file__).parent
CLASSES = ("every row its 3-gram", "every row its 2-gram, not all their 3-gram", "some row neither")

drafted: list[str] = []  # the class of each tree cycle drafted, in order
probes: list[tuple[str, dict]] = []  # (class, tokens per row) of each probe


def propose(self, roots):
    with torch.inference_mode():
        three = all(bool(c.lookup(1, [3])[1][0]) for c in self.contexts)
        two = all(bool(c.lookup(1, [3, 2])[1][0]) for c in self.contexts)
    drafted.append(CLASSES[0] if three else CLASSES[1] if two else CLASSES[2])
    return original_propose(self, roots)


def observe(self, shape, emitted, width=None):
    if shape is not PLAIN and (self.plain_run > 0 or self.weight == 0):
        probes.append((drafted[-1], dict(emitted)))
    return original_observe(self, shape, emitted, width)


original_propose, original_observe = BatchPromptLookup.propose, ShapePolicy.observe
BatchPromptLookup.propose, ShapePolicy.observe = propose, observe
BatchPromptLookup.promising = lambda self: True  # the gate off: every probe the policy asks for runs


def prompts_for(gen: SpecGenerator, turn: int, count: int) -> list[torch.Tensor]:
    questions = load_questions("mt_bench", count)
    chats = [[{"role": "user", "content": q["turns"][0]}] for q in questions]
    firsts = [gen.encode(c) for c in chats]
    if turn == 1:
        return firsts
    answers = decode_rows(gen.backend, None, firsts, [ANSWER] * count, SamplingConfig(), gen.eos_ids(None), None,
                          GenerationStats())
    return [gen.encode(c + [{"role": "assistant", "content": gen.tokenizer.decode(a, skip_special_tokens=True)},
                            {"role": "user", "content": q["turns"][1]}])
            for c, a, q in zip(chats, answers, questions, strict=True)]


runs, generators = [], {}
for dtype, rows, turn, count in SETTINGS:
    if dtype not in generators:
        generators[dtype] = SpecGenerator.from_pretrained("smollm2-135m-instruct", dtype=dtype, lookup=10)
    gen = generators[dtype]
    prompts = prompts_for(gen, turn, count)
    probes.clear()
    for g in range(0, count, rows):
        gen.generate(prompts[g : g + rows], max_new_tokens=NEW)
    shapes = [s.name for s in gen.batch_shapes(rows)]
    classes = {}
    for name in CLASSES:
        got = [e for c, e in probes if c == name]
        classes[name] = {"probes": len(got),
                         "slowest_row_tokens": statistics.mean(min(e.values()) for e in got) if got else None,
                         "mean_row_tokens": statistics.mean(statistics.mean(e.values()) for e in got) if got else None}
    runs.append({"dtype": dtype, "rows": rows, "turn": turn, "prompts": count, "shapes": shapes, "classes": classes})
    print(runs[-1], flush=True)

result = {"new_tokens": NEW, "answer_tokens": ANSWER, "lookup": 10, "runs": runs, "machine": machine_info(),
          "command": "OMP_NUM_THREADS=1 python benchmarks/results/batch-adapt/gate.py"}
(HERE / "gate.json").write_text(json.dumps(result, indent=1) + "\n")


def cell(c: dict) -> str:
    if not c["probes"]:
        return "-"
    return f"{c['slowest_row_tokens']:.2f} / {c['mean_row_tokens']:.2f} ({c['probes']})"


lines = ["# What a batch's probes give by the n-grams their rows repeat\n",
         f"Batches adapting with the probe gate off (greedy, {NEW} new tokens, each row's lookup chain of 10; second "
         f"turns after a greedy first answer of at most {ANSWER} tokens). Each probe is classed by what the rows' "
         "contexts repeated when it was drafted. Cells: tokens the slowest row emitted / mean tokens per row "
         "(probes).\n",
         "| dtype | batch | MT-Bench turn | prompts | probed shape | " + " | ".join(CLASSES) + " |",
         "| --- | --- | --- | --- | --- | --- | --- | --- |"]
for r in runs:
    lines.append(f"| {r['dtype']} | {r['rows']} | {r['turn']} | {r['prompts']} | {', '.join(r['shapes']) or '-'} | "
                 + " | ".join(cell(r["classes"][name]) for name in CLASSES) + " |")
lines += ["", f"Command: `{result['command']}`", "", machine_text(result["machine"])]
(HERE / "gate.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
