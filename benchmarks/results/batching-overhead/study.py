"""Does ``SpecGenerator.generate(list)`` cost more than the batched plain loop it runs when no tree is kept?

    OMP_NUM_THREADS=1 python benchmarks/results/batching-overhead/study.py

Batch 8 of the first 8 MT-Bench first turns, fp32, 64 new tokens, the tree off (``total_tokens=0``): the generator's
batched path is then :func:`griffin.batch.decode_rows` without a drafter plus its own work (checks, tuning lookup,
padding the output, decoding the texts). Times ``generate(list)`` and ``decode_rows`` alone in alternating order,
and profiles one ``generate`` call for the time spent outside ``decode_rows``. Writes ``study.json`` and ``study.md``
beside this file.
"""

import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from griffin import SpecGenerator
from griffin.batch import decode_rows
from griffin.decode import GenerationStats
from griffin.report import machine_info, machine_text
from griffin.sampling import SamplingConfig
from inference.questions import load_questions

REPEATS, ROWS, NEW = 6, 8, 64
HERE = Path(__file__).parent

gen = SpecGenerator.from_pretrained("smollm2-135m-instruct", dtype="fp32", total_tokens=0, depth=1)
prompts = [gen.encode([{"role": "user", "content": q["turns"][0]}]) for q in load_questions("mt_bench", ROWS)]
eos = gen.eos_ids(None)


def ours() -> list[list[int]]:
    return gen.generate(prompts, max_new_tokens=NEW).tokens


def plain() -> list[list[int]]:
    return decode_rows(gen.backend, None, prompts, [NEW] * ROWS, SamplingConfig(), eos, None, GenerationStats())


assert ours() == plain()  # warm-up, and the same tokens
times: dict[str, list[float]] = {"generate(list)": [], "decode_rows": []}
for r in range(REPEATS):
    order = [("generate(list)", ours), ("decode_rows", plain)]
    for name, fn in order if r % 2 == 0 else order[::-1]:
        t0 = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t0)
profile = cProfile.Profile()
profile.enable()
ours()
profile.disable()
stats = pstats.Stats(profile).stats
total = next(v[3] for k, v in stats.items() if k[2] == "generate" and k[0].endswith("generator.py"))
inner = next(v[3] for k, v in stats.items() if k[2] == "decode_rows")
ratios = [p / o for o, p in zip(times["generate(list)"], times["decode_rows"])]
result = {"rows": ROWS, "new_tokens": NEW, "dtype": "fp32", "repeats": REPEATS, "seconds": times,
          "speed_ratio_per_pair": ratios, "profiled_generate_s": total, "profiled_decode_rows_s": inner,
          "outside_decode_rows_s": total - inner, "machine": machine_info(),
          "command": "OMP_NUM_THREADS=1 python benchmarks/results/batching-overhead/study.py"}
(HERE / "study.json").write_text(json.dumps(result, indent=1) + "\n")
mean = statistics.mean(ratios)
se = statistics.stdev(ratios) / len(ratios) ** 0.5
rows = "\n".join(f"| {i + 1} | {o:.2f} | {p:.2f} | {p / o:.3f} |"
                 for i, (o, p) in enumerate(zip(times["generate(list)"], times["decode_rows"])))
(HERE / "study.md").write_text(
    f"# generate(list) against decode_rows at batch {ROWS}, no tree (fp32, {NEW} new tokens)\n\n"
    "| pair | generate(list) s | decode_rows s | speed of generate / decode_rows |\n| --- | --- | --- | --- |\n"
    f"{rows}\n\nMean speed ratio {mean:.3f} ± {se:.3f} (s.e., {REPEATS} pairs, order alternating). Profiled: one "
    f"`generate(list)` call took {total:.3f} s, of which {total - inner:.4f} s outside `decode_rows`.\n\n"
    f"Command: `{result['command']}`\n\n{machine_text(result['machine'])}\n")
print((HERE / "study.md").read_text())
