"""Which of the target's greedy continuation tokens a head can propose: its static draft vocabulary alone, and with
the tokens of the context (prompt and continuation so far), as the shipped heads' ``context_vocab`` adds them; and
how a larger static vocabulary would cover them: the N most frequent assistant tokens of the first ``RECORDS``
ShareGPT records (training data; tokenized without the chat template, so an estimate of the store's ranking).

    python benchmarks/results/recipe3-tau/coverage.py

Reads the continuation cache of ``inference.tau`` (MT-Bench T=0, the first 80 prompts, as the τ files here) and
writes ``coverage.{json,md}`` beside this file.
"""

import itertools
import json
from pathlib import Path

import torch

from griffin import DraftModel
from griffin.report import markdown_table, write_benchmark
from griffin.target import load_target
from training.data import BadConversation, iter_records, to_messages

HERE = Path("benchmarks/results/recipe3-tau")  # run from the repository root
CACHE = Path("benchmarks/results/continuations/mt_bench-smollm2-135m-instruct-9f60b57a-T0-seed0-n128-all.json")
HEADS = ["checkpoints/smollm2-135m-instruct-griffin", "checkpoints/smollm2-135m-instruct-recipe3/wip-eagle3",
         "checkpoints/smollm2-135m-instruct-recipe3/wip-griffin3"]
PROMPTS = 80
RECORDS = 4096
SIZES = [8192, 12288, 16384, 24576, 32768]


def sharegpt_ranking() -> torch.Tensor:
    """Token ids [V], most frequent first, over the assistant turns of the first ``RECORDS`` ShareGPT records."""
    _, tokenizer = load_target()
    counts = torch.zeros(len(tokenizer), dtype=torch.long)
    for record in itertools.islice(iter_records(), RECORDS):
        try:
            messages = to_messages(record)
        except BadConversation:
            continue
        for m in messages:
            if m["role"] == "assistant":
                ids = tokenizer(m["content"], add_special_tokens=False)["input_ids"][:1024]
                counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=counts.shape[0])
    return torch.argsort(counts, descending=True)


def main() -> None:
    samples = [json.loads(line) for line in CACHE.read_text().splitlines()[1:]][:PROMPTS]
    rows, result = [], {"continuations": str(CACHE), "prompts": len(samples), "heads": {}}
    for path in HEADS:
        draft = DraftModel.from_pretrained(path)
        static = set(draft.static_vocab().tolist())
        positions = in_static = in_context = 0
        for s in samples:
            seen = set(s["prompt"])
            for token in s["continuation"]:
                positions += 1
                in_static += token in static
                in_context += token in static or token in seen
                seen.add(token)
        uses_context = bool(draft.config.context_vocab)
        result["heads"][path] = {"static_size": len(static), "context_vocab": uses_context, "positions": positions,
                                 "static": in_static / positions, "with_context": in_context / positions}
        rows.append([path, len(static), "yes" if uses_context else "no", positions, f"{in_static / positions:.3f}",
                     f"{in_context / positions:.3f}"])
    ranking, tokens = sharegpt_ranking(), torch.tensor([t for s in samples for t in s["continuation"]])
    sizes = []
    for n in SIZES:
        member = torch.zeros(ranking.shape[0], dtype=torch.bool)
        member[ranking[:n]] = True
        sizes.append([n, f"{member[tokens].float().mean().item():.3f}"])
    result["static_sizes"] = {n: float(c) for n, c in sizes}
    text = ("# Continuation tokens a head can propose\n\nThe target's greedy continuations of the first "
            f"{len(samples)} MT-Bench prompts (`{CACHE}`): the fraction of their tokens in each head's static draft "
            "vocabulary, and in it or in the context before them (what a head with `context_vocab` can propose).\n\n"
            + markdown_table(["head", "static vocabulary", "context_vocab", "tokens", "in the static vocabulary",
                              "static or in the context"], rows)
            + f"\nA static vocabulary of the N most frequent assistant tokens of the first {RECORDS} ShareGPT records "
            "(an estimate of a store's ranking: no chat template), the same continuations:\n\n"
            + markdown_table(["N", "in the static vocabulary"], sizes)
            + "\nCommand: `python benchmarks/results/recipe3-tau/coverage.py`\n")
    write_benchmark(HERE, "coverage", result, text)


if __name__ == "__main__":
    main()
