"""One request earning its chain's length (batch 1), against the full chain, on a quiet machine.

    python benchmarks/results/amd-epyc-zen4/chain-earned-b1.py           # first turns
    python benchmarks/results/amd-epyc-zen4/chain-earned-b1.py --turn 2  # second turns

``chain-earned.md``: at batch 2 a row that earns its chain's length (2 tokens at first, doubled up to the whole chain
after the target took all it offered, cut to what it took, at least 1, otherwise) gained on first turns and kept the
second turns' copies. Does one request gain the same? At batch 1 a chain the target rejects widens only its own pass.
``EarnedLookup`` here is :class:`griffin.drafters.PromptLookup` with that rule; the generator builds it in place of
its own (``earned``) or as it is (``full``), everything else as shipped: the tuned tree, adapting per request, the
10-token chain, the shipped head.

The first 32 MT-Bench first turns (``--turn 2``: their second turns, after the plain loop's greedy first answer of at
most 256 tokens), greedy, 64 new tokens, each prompt decoded by the plain loop and both arms in turns (order reversed
every other prompt) after a warm-up, fp32 and bf16, the machine's torch threads. Speedup: a prompt's tokens/s over
the plain loop's on the same prompt (wall time with the prefill), mean ± standard error over prompts. Writes
``chain-earned-b1.{json,md}`` (``chain-earned-b1-turn2.*``) beside this file.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

import griffin.generator
from griffin import SpecGenerator
from griffin.drafters import PromptLookup
from griffin.report import machine_info, machine_text, markdown_table, write_benchmark
from griffin.tree import Tree, graft
from inference.questions import load_questions

HERE = Path(__file__).parent
PROMPTS, BUDGET, CHAIN, ANSWER, FIRST = 32, 64, 10, 256, 2
METHODS = ("plain loop", "full chain", "earned chain")


class EarnedLookup(PromptLookup):
    """The request offers at most ``limit`` of the chain tokens it found (trim only, as on the CPU)."""

    def start(self, ids: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> None:
        super().start(ids, hidden, token)
        self.limit, self.offered = FIRST, []

    def propose(self, token: torch.Tensor) -> Tree:
        chain, valid = self.lookup()
        real = min(int(valid.sum()), self.limit)  # the chain's real tokens are a prefix
        self.offered = chain[:real].tolist()
        tree = self.inner.propose(token)
        return (graft(tree, chain[:real], valid[:real]) if real else tree).compact()

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        if self.offered:  # the offered tokens the target emitted, from the first
            row = tokens.tolist()
            taken = next((i for i, (a, t) in enumerate(zip(self.offered, row)) if a != t),
                         min(len(self.offered), len(row)))
            self.limit = min(self.tokens, 2 * self.limit) if taken == len(self.offered) else max(1, taken)
            self.offered = []
        super().accept(tokens, hidden)


def new_tokens(gen: SpecGenerator, ids: torch.Tensor, budget: int) -> list[int]:
    return gen.generate(ids, max_new_tokens=budget).sequences[0, ids.shape[0] :].tolist()


def measure(dtype: str, turn: int) -> dict:
    torch.manual_seed(0)
    gen = SpecGenerator.from_pretrained("smollm2-135m-instruct", dtype=dtype, lookup=CHAIN)
    plain = SpecGenerator.from_pretrained("smollm2-135m-instruct", dtype=dtype, total_tokens=0)
    questions = load_questions("mt_bench")[:PROMPTS]
    chats = [[{"role": "user", "content": q["turns"][0]}] for q in questions]
    if turn == 2:
        answers = [new_tokens(plain, plain.encode(c), ANSWER) for c in chats]
        chats = [c + [{"role": "assistant", "content": gen.tokenizer.decode(a, skip_special_tokens=True)},
                      {"role": "user", "content": q["turns"][1]}]
                 for c, a, q in zip(chats, answers, questions, strict=True)]
    prompts = [gen.encode(c) for c in chats]

    def run(method: str, ids: torch.Tensor) -> tuple[list[int], float]:
        griffin.generator.PromptLookup = EarnedLookup if method == "earned chain" else PromptLookup
        start = time.perf_counter()
        out = new_tokens(plain if method == "plain loop" else gen, ids, BUDGET)
        return out, time.perf_counter() - start

    for m in METHODS:  # warm-up
        run(m, prompts[0])
    rates: dict[str, list[float]] = {m: [] for m in METHODS}
    tokens = dict.fromkeys(METHODS, 0)
    for i, ids in enumerate(prompts):
        outs = {}
        for m in METHODS if i % 2 == 0 else METHODS[::-1]:
            outs[m], seconds = run(m, ids)
            rates[m].append(len(outs[m]) / seconds)
            tokens[m] += len(outs[m])
        if dtype == "fp32" and len({tuple(o) for o in outs.values()}) != 1:
            raise SystemExit(f"prompt {i}: the methods' fp32 outputs differ")
    griffin.generator.PromptLookup = PromptLookup
    methods = {}
    for m in METHODS:
        ratios = [r / p for r, p in zip(rates[m], rates["plain loop"], strict=True)]
        diffs = [(e - f) / p for e, f, p in zip(rates["earned chain"], rates["full chain"], rates["plain loop"],
                                                strict=True)]
        methods[m] = {"tokens": tokens[m], "tokens_per_s": statistics.fmean(rates[m]),
                      **({} if m == "plain loop" else {"mean": statistics.fmean(ratios),
                                                       "se": statistics.stdev(ratios) / len(ratios) ** 0.5})}
        if m == "earned chain":
            methods[m]["minus_full"] = {"mean": statistics.fmean(diffs),
                                        "se": statistics.stdev(diffs) / len(diffs) ** 0.5}
    return {"dtype": dtype, "tree": f"{gen.total_tokens} nodes, depth {gen.depth}", "methods": methods}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turn", type=int, choices=[1, 2], default=1)
    turn = p.parse_args().turn
    command = "python benchmarks/results/amd-epyc-zen4/chain-earned-b1.py" + (" --turn 2" * (turn == 2))
    result = {"prompts": PROMPTS, "turn": turn, "answer_tokens": ANSWER if turn == 2 else None, "budget": BUDGET,
              "runs": [measure(d, turn) for d in ("fp32", "bf16")], "command": command, "machine": machine_info()}
    turns = "first turns" if turn == 1 else f"second turns (after the plain loop's first answer of at most {ANSWER} " \
        "tokens)"
    table = [[run["dtype"], run["tree"], m, r["tokens"], f"{r['tokens_per_s']:.1f}",
              "-" if m == "plain loop" else f"{r['mean']:.3f} ± {r['se']:.3f}",
              f"{r['minus_full']['mean']:+.3f} ± {r['minus_full']['se']:.3f}" if "minus_full" in r else "-"]
             for run in result["runs"] for m, r in run["methods"].items()]
    text = (f"# One request earning its chain (batch 1) · smollm2-135m-instruct{' · second turns' * (turn == 2)}"
            "\n\n"
            f"The first {PROMPTS} MT-Bench {turns}, greedy, {BUDGET} new tokens, each prompt decoded by every method "
            "in turns after a warm-up; the shipped generator (tuned tree, adapting per request) with its "
            f"{CHAIN}-token prompt-lookup chain as the request earned it and in full, against the plain loop. "
            "Tokens/s: mean over prompts (wall time with the prefill); speedup: mean ± standard error of the prompts' "
            "ratios to the plain loop; last column: earned minus full, by prompt. In fp32 every method's tokens were "
            "checked equal.\n\n"
            + markdown_table(["dtype", "tree (tuned)", "method", "new tokens", "tokens/s", "speedup over the plain "
                              "loop", "earned − full"], table)
            + f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(result['machine'])}; load average "
            f"{result['machine']['load_average_1m']} when written (this run's own threads count in it).\n")
    write_benchmark(HERE, "chain-earned-b1" + ("-turn2" if turn == 2 else ""), result, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
