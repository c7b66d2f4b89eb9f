"""Each row earning its chain's length at batch 2, against the full chain and none, on a quiet machine.

    OMP_NUM_THREADS=1 python benchmarks/results/amd-epyc-zen4/chain-earned.py           # first turns
    OMP_NUM_THREADS=1 python benchmarks/results/amd-epyc-zen4/chain-earned.py --turn 2  # second turns

``batch-lookup.md``: at batch 2 the full 10-token chain cost on first turns in fp32 and paid on second turns. Can a
row earn its chain's length, so that first turns stop paying for chains the target rejects while second turns keep
the copies? The ``earned`` arm lets each row offer at most as many chain tokens as it has earned (2 at first,
doubled up to the whole chain after a fully accepted chain, cut to what was accepted, at least 1, otherwise); the
``full`` arm offers all it found; the third has no chain. The committed figures were measured with the earned rule in
a subclass here; it then moved into :class:`griffin.batch.BatchPromptLookup` unchanged, whose ``earn=None`` is the
``full`` arm.

Fixed depth-1 trees of 2 and 3 nodes in each arm against the batched plain loop (:func:`griffin.batch.decode_rows` for
all of them), the first 16 MT-Bench first turns (``--turn 2``: their second turns, after the plain loop's greedy first
answer of at most 256 tokens, which the second often copies from) in groups of 2, greedy, 64 new tokens, the methods in
turns (order reversed every other group) after a warm-up, fp32 and bf16, the shipped head. Speedup: a group's tokens/s
over the plain loop's in the same group (wall time with the prefill), mean ± standard error over the 8 groups. Writes
``chain-earned.{json,md}`` (``chain-earned-turn2.*``) beside this file.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from griffin import SpecGenerator
from griffin.batch import BatchHeadDrafter, BatchPromptLookup, decode_rows
from griffin.decode import GenerationStats
from griffin.report import machine_info, machine_text, markdown_table, write_benchmark
from griffin.sampling import SamplingConfig
from inference.questions import load_questions

HERE = Path(__file__).parent
ROWS, PROMPTS, BUDGET, CHAIN, ANSWER, FIRST = 2, 16, 64, 10, 256, 2
ARMS = ("earned", "full", "none")
TREES = [(1, nodes, arm) for nodes in (2, 3) for arm in ARMS]  # depth, nodes, chain arm


def name(tree: tuple[int, int, str]) -> str:
    depth, nodes, arm = tree
    return f"{nodes} nodes, depth {depth}, " + {"earned": "earned chain", "full": "full chain", "none": "no chain"}[arm]


def measure(dtype: str, turn: int) -> dict:
    torch.manual_seed(0)
    gen = SpecGenerator.from_pretrained("smollm2-135m-instruct", dtype=dtype, total_tokens=0)
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

    def run(tree: tuple[int, int, str] | None, batch: list[torch.Tensor]) -> list[list[int]]:
        drafter = None
        if tree is not None:
            depth, nodes, arm = tree
            longest = max(p.shape[0] for p in batch) + BUDGET
            drafter = BatchHeadDrafter(gen.draft, depth, gen.top_k, nodes, len(batch), longest)
            if arm != "none":
                drafter = BatchPromptLookup(drafter, CHAIN, longest, gen.lookup_ngrams, trim=True,
                                            earn=FIRST if arm == "earned" else None)
        return decode_rows(gen.backend, drafter, batch, [BUDGET] * len(batch), SamplingConfig(), eos, None,
                           GenerationStats())

    methods = {"plain loop": None} | {name(t): t for t in TREES}
    for tree in methods.values():  # warm-up
        run(tree, prompts[:ROWS])
    rates: dict[str, list[float]] = {m: [] for m in methods}
    tokens = dict.fromkeys(methods, 0)
    for g in range(0, PROMPTS, ROWS):
        order = list(methods) if (g // ROWS) % 2 == 0 else list(methods)[::-1]
        for m in order:
            start = time.perf_counter()
            out = run(methods[m], prompts[g : g + ROWS])
            rates[m].append(sum(len(t) for t in out) / (time.perf_counter() - start))
            tokens[m] += sum(len(t) for t in out)
    ratios = {m: [r / p for r, p in zip(rates[m], rates["plain loop"], strict=True)] for m in methods}
    rows = {m: {"tokens": tokens[m], "tokens_per_s": statistics.mean(rates[m]), "group_rates": rates[m],
                **mean_se(ratios[m])} for m in methods}
    for depth, nodes, arm in TREES:
        if arm == "earned":  # minus the other arms, group by group
            earned = ratios[name((depth, nodes, arm))]
            for other in ("full", "none"):
                rows[name((depth, nodes, arm))][f"minus_{other}"] = mean_se(
                    [a - b for a, b in zip(earned, ratios[name((depth, nodes, other))], strict=True)])
    return {"dtype": dtype, "methods": rows}


def mean_se(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "se": statistics.stdev(values) / len(values) ** 0.5}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turn", type=int, choices=[1, 2], default=1)
    turn = p.parse_args().turn
    command = "OMP_NUM_THREADS=1 python benchmarks/results/amd-epyc-zen4/chain-earned.py" + (" --turn 2" * (turn == 2))
    result = {"rows": ROWS, "prompts": PROMPTS, "turn": turn, "answer_tokens": ANSWER if turn == 2 else None,
              "budget": BUDGET, "runs": [measure(d, turn) for d in ("fp32", "bf16")], "command": command,
              "machine": machine_info()}
    turns = "first turns" if turn == 1 else f"second turns (after the plain loop's first answer of at most {ANSWER} " \
        "tokens)"
    table = [[run["dtype"], m, r["tokens"], f"{r['tokens_per_s']:.1f}",
              "-" if m == "plain loop" else f"{r['mean']:.3f} ± {r['se']:.3f}",
              *(f"{r[k]['mean']:+.3f} ± {r[k]['se']:.3f}" if k in r else "-" for k in ("minus_full", "minus_none"))]
             for run in result["runs"] for m, r in run["methods"].items()]
    text = (f"# Rows earning their chains at batch {ROWS} · smollm2-135m-instruct{' · second turns' * (turn == 2)}"
            "\n\n"
            f"The first {PROMPTS} MT-Bench {turns} in groups of {ROWS}, greedy, {BUDGET} new tokens, each group "
            "decoded by every method in turns after a warm-up; fixed depth-1 trees of the shipped head with each row's "
            f"{CHAIN}-token prompt-lookup chain as it earned it, with the full chain, and without, against the batched "
            "plain loop. Tokens/s: mean over groups "
            "(wall time with the prefill); speedup: mean ± standard error of the groups' ratios to the plain loop; "
            "the last columns: the same tree's speedup with the earned chain minus the other arms', by group.\n\n"
            + markdown_table(["dtype", "method", "new tokens", "tokens/s", "speedup over the plain loop",
                              "earned − full", "earned − none"], table)
            + f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(result['machine'])}; load average "
            f"{result['machine']['load_average_1m']} when written.\n")
    write_benchmark(HERE, "chain-earned" + ("-turn2" if turn == 2 else ""), result, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
