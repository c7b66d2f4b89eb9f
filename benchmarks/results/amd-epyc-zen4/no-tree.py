"""Where the tuner keeps no tree, is ``SpecGenerator.generate`` on a batch as fast as the batched plain loop?

    OMP_NUM_THREADS=1 python benchmarks/results/amd-epyc-zen4/no-tree.py

``batching-first.md`` reads 0.94x at batch 8 and 0.95x at batch 16 in fp32, where ours drafted nothing and so runs
:func:`griffin.batch.decode_rows` without a drafter, the plain loop it is compared with; those were two groups and
one, on shared cores. This times the two alone, alternating which goes first, on the machine kept quiet: the first
8 (or 16) MT-Bench first turns, greedy, 48 new tokens, fp32, six runs each after a warm-up. Writes ``no-tree.{json,md}``
beside this file.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from griffin import SpecGenerator
from griffin.batch import decode_rows
from griffin.decode import GenerationStats
from griffin.report import machine_info, machine_text, markdown_table, write_benchmark
from griffin.sampling import SamplingConfig
from inference.questions import load_questions

HERE = Path(__file__).parent
BATCHES, BUDGET, RUNS = (8, 16), 48, 6


def main() -> int:
    torch.manual_seed(0)
    gen = SpecGenerator.from_pretrained("smollm2-135m-instruct", dtype="fp32")
    eos = gen.eos_ids(None)
    questions = load_questions("mt_bench")[: max(BATCHES)]
    prompts = [gen.encode([{"role": "user", "content": q["turns"][0]}]) for q in questions]

    def ours(batch: list[torch.Tensor]) -> list[list[int]]:
        return gen.generate(batch, max_new_tokens=BUDGET).tokens

    def plain(batch: list[torch.Tensor]) -> list[list[int]]:
        return decode_rows(gen.backend, None, batch, [BUDGET] * len(batch), SamplingConfig(), eos, None,
                           GenerationStats())

    methods = {"ours": ours, "plain loop": plain}
    result, rows = {"budget": BUDGET, "runs": RUNS, "batches": {}}, []
    for b in BATCHES:
        batch = prompts[:b]
        if gen.batch_tree(b)[1] or gen.batch_shapes(b):
            raise SystemExit(f"the tuner drafts at batch {b} on this machine: nothing to compare here")
        for method in methods.values():  # warm-up
            method(batch)
        rates: dict[str, list[float]] = {m: [] for m in methods}
        same = True
        for run in range(RUNS):
            order = list(methods) if run % 2 == 0 else list(methods)[::-1]
            outputs = {}
            for name in order:
                start = time.perf_counter()
                outputs[name] = methods[name](batch)
                rates[name].append(sum(len(t) for t in outputs[name]) / (time.perf_counter() - start))
            same = same and outputs["ours"] == outputs["plain loop"]
        ratios = [o / p for o, p in zip(rates["ours"], rates["plain loop"], strict=True)]
        mean, se = statistics.fmean(ratios), statistics.stdev(ratios) / len(ratios) ** 0.5
        result["batches"][str(b)] = {"tokens_per_s": rates, "ratios": ratios, "mean": mean, "se": se,
                                     "identical": same}
        rows.append([b, f"{statistics.fmean(rates['ours']):.1f}", f"{statistics.fmean(rates['plain loop']):.1f}",
                     f"{mean:.3f} ± {se:.3f}", "yes" if same else "no"])
    result |= {"command": "python benchmarks/results/amd-epyc-zen4/no-tree.py", "machine": machine_info()}
    text = ("# Ours where the tuner keeps no tree, against the batched plain loop\n\n"
            f"fp32, the first MT-Bench first turns, greedy, {BUDGET} new tokens, {RUNS} runs of each method per batch "
            "size, alternating which goes first, after a warm-up; the second core kept idle. Ratio: each run's "
            "tokens/s of ours over the plain loop's, mean ± standard error.\n\n"
            + markdown_table(["B", "ours tok/s", "plain loop tok/s", "ours / plain loop", "same tokens"], rows)
            + f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(result['machine'])}.\n")
    write_benchmark(HERE, "no-tree", result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
