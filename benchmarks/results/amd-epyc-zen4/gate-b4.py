"""Batch 4 adapting with its probe gate open, against the gate as shipped and the batched plain loop.

    OMP_NUM_THREADS=1 python benchmarks/results/amd-epyc-zen4/gate-b4.py

On this machine the batch-4 tuner keeps no tree, and :meth:`griffin.SpecGenerator.batch_shapes` keeps batch 4 from
adapting either: a probe of its best tree (1 node, depth 1) with every row's full lookup chain is priced above
:data:`griffin.adapt.PROBE_EXCESS` plain steps beyond what it gives (:func:`griffin.adapt.probe_excess`). So the
copying of MT-Bench's second turns, which pays at batch 1 and 2, goes unused at batch 4
(``batching-curve-turn2.md``). Does the gate cost those gains? The ``open`` arm sets ``PROBE_EXCESS`` out of reach, so
that batch 4 adapts as batch 2 does where its tuner keeps no tree (probing only where every row's context repeats its
last n-gram); ``shipped`` is the library as it is (here: the batched plain loop).

The first 32 MT-Bench first turns, and their second turns (after the plain loop's greedy first answer of at most 48
tokens, as the batch tuner's check builds them), in groups of 4, greedy, 64 new tokens, the three methods in rotating
order after a warm-up, fp32 and bf16, the shipped head with its 10-token lookup chain, one torch thread. Speedup: a
group's wall time with the plain loop over the method's (prefill included), mean ± standard error over the 8 groups,
and the ratio of the totals. Writes ``gate-b4.{json,md}`` beside this file.
"""

import statistics
import time
from pathlib import Path

import torch

import griffin.generator as generator_module
from griffin import SpecGenerator
from griffin.batch import decode_rows
from griffin.decode import GenerationStats
from griffin.report import machine_info, machine_text, markdown_table, write_benchmark
from griffin.sampling import SamplingConfig
from inference.questions import load_questions

HERE = Path(__file__).parent
ROWS, PROMPTS, BUDGET, ANSWER, LOOKUP = 4, 32, 64, 48, 10
METHODS = ("shipped", "open", "plain loop")
SHIPPED = generator_module.PROBE_EXCESS


def measure(dtype: str, turn: int) -> dict:
    torch.manual_seed(0)
    gen = SpecGenerator.from_pretrained("smollm2-135m-instruct", dtype=dtype, lookup=LOOKUP)
    eos = gen.eos_ids(None)
    questions = load_questions("mt_bench")[:PROMPTS]
    chats = [[{"role": "user", "content": q["turns"][0]}] for q in questions]
    prompts = [gen.encode(c) for c in chats]
    if turn == 2:
        answers = decode_rows(gen.backend, None, prompts, [ANSWER] * len(prompts), SamplingConfig(), eos, None,
                              GenerationStats())
        prompts = [gen.encode(c + [{"role": "assistant", "content": gen.tokenizer.decode(a, skip_special_tokens=True)},
                                   {"role": "user", "content": q["turns"][1]}])
                   for c, a, q in zip(chats, answers, questions, strict=True)]
    tree = gen.batch_tree(ROWS)
    probes: dict[str, int] = dict.fromkeys(METHODS, 0)

    def run(method: str, batch: list[torch.Tensor]) -> list[list[int]]:
        if method == "plain loop":
            return decode_rows(gen.backend, None, batch, [BUDGET] * len(batch), SamplingConfig(), eos, None,
                               GenerationStats())
        generator_module.PROBE_EXCESS = SHIPPED if method == "shipped" else float("inf")
        gen._batch_shapes.clear()  # the batch's shapes are worked out again under this gate
        try:
            out = gen.generate(batch, max_new_tokens=BUDGET)
        finally:
            generator_module.PROBE_EXCESS = SHIPPED
        probes[method] += sum(out.stats.shapes.values())
        return out.tokens

    for method in METHODS:  # warm-up
        run(method, prompts[:ROWS])
    probes = dict.fromkeys(METHODS, 0)
    seconds: dict[str, list[float]] = {m: [] for m in METHODS}
    identical = 0
    for g, start in enumerate(range(0, PROMPTS, ROWS)):
        batch, outputs = prompts[start : start + ROWS], {}
        for method in METHODS[g % 3 :] + METHODS[: g % 3]:
            began = time.perf_counter()
            outputs[method] = run(method, batch)
            seconds[method].append(time.perf_counter() - began)
        identical += outputs["shipped"] == outputs["open"] == outputs["plain loop"]
    rows = {}
    for method in METHODS[:2]:
        ratios = [p / s for p, s in zip(seconds["plain loop"], seconds[method], strict=True)]
        rows[method] = {"seconds": seconds[method], "tree_cycles": probes[method],
                        "total_ratio": sum(seconds["plain loop"]) / sum(seconds[method]),
                        "mean": statistics.mean(ratios), "se": statistics.stdev(ratios) / len(ratios) ** 0.5}
    gain = [s / o for s, o in zip(seconds["shipped"], seconds["open"], strict=True)]
    return {"dtype": dtype, "turn": turn, "batch_tree": list(tree), "plain_seconds": seconds["plain loop"],
            "methods": rows, "open_over_shipped": {"mean": statistics.mean(gain),
                                                   "se": statistics.stdev(gain) / len(gain) ** 0.5},
            "identical_groups": identical if dtype == "fp32" else None, "groups": len(gain)}


def main() -> int:
    torch.set_num_threads(1)
    runs = [measure(dtype, turn) for turn in (1, 2) for dtype in ("fp32", "bf16")]
    result = {"rows": ROWS, "prompts": PROMPTS, "budget": BUDGET, "answer_tokens": ANSWER, "lookup": LOOKUP,
              "runs": runs, "command": "OMP_NUM_THREADS=1 python benchmarks/results/amd-epyc-zen4/gate-b4.py",
              "machine": machine_info()}
    table = []
    for run in runs:
        shipped, opened = run["methods"]["shipped"], run["methods"]["open"]
        tree = "no tree" if run["batch_tree"][1] == 0 else f"{run['batch_tree'][1]} nodes, depth {run['batch_tree'][0]}"
        table.append(["first" if run["turn"] == 1 else "second", run["dtype"], tree,
                      f"{shipped['total_ratio']:.3f}x ({shipped['mean']:.3f} ± {shipped['se']:.3f})",
                      f"{opened['total_ratio']:.3f}x ({opened['mean']:.3f} ± {opened['se']:.3f})",
                      opened["tree_cycles"],
                      f"{run['open_over_shipped']['mean']:.3f} ± {run['open_over_shipped']['se']:.3f}",
                      "-" if run["identical_groups"] is None else f"{run['identical_groups']}/{run['groups']}"])
    text = (f"# Batch {ROWS} with its probe gate open · smollm2-135m-instruct\n\n"
            f"The first {PROMPTS} MT-Bench first turns and their second turns (after the plain loop's greedy first "
            f"answer of at most {ANSWER} tokens) in groups of {ROWS}, greedy, {BUDGET} new tokens, the methods in "
            "rotating order after a warm-up, one torch thread. `shipped`: the library as it is; `open`: batch "
            f"{ROWS} adapting whatever a probe costs (`PROBE_EXCESS` out of reach). Speedup over the batched plain "
            "loop: the ratio of total times (the mean ± standard error of the groups' ratios); tree cycles: the "
            "open arm's probes and the tree cycles after them, all groups; open / shipped: by group.\n\n"
            + markdown_table(["turn", "dtype", f"batch-{ROWS} tree (tuned)", "shipped over plain",
                              "open over plain", "open: tree cycles", "open / shipped", "identical groups (fp32)"],
                             table)
            + f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(result['machine'])}; load average "
            f"{result['machine']['load_average_1m']} when written.\n")
    write_benchmark(HERE, "gate-b4", result, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
