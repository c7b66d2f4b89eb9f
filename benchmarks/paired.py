"""Generators taking turns on the same MT-Bench prompts: the loop and settings the paired CPU studies share.

Per prompt (the first ``--per-category`` MT-Bench questions of each category, the second turn after the reference
generator's first answer), every generator writes up to ``--max-new-tokens`` tokens in turn, timed, and each must
write the reference's tokens. Used by ``benchmarks.chain_trim`` and ``benchmarks.adaptive_vs_fixed``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from griffin.cli import positive_int
from griffin.constants import EMBEDDED_TARGET
from inference.questions import first_per_category, load_questions


def study_parser(prog: str, doc: str, out: str) -> argparse.ArgumentParser:
    """A study's parser with the settings every paired study takes; ``out`` is its default result path."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--per-category", type=positive_int, default=2, help="MT-Bench questions per category")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--depth", type=positive_int, default=3, help="the fixed tree's depth")
    p.add_argument("--total-tokens", type=positive_int, default=6, help="the fixed tree's nodes")
    p.add_argument("--lookup", type=int, default=10, help="the prompt-lookup chain's tokens")
    p.add_argument("--out", default=out, help="path without suffix")
    return p


def take_turns(generate: Callable[[str, object], tuple[float, object]], names: list[str], encode: Callable,
               per_category: int, record: Callable[[str, object], dict] | None = None) -> list[dict]:
    """One row per prompt: ``row[name]`` holds tokens/s, τ and new tokens of ``generate(name, ids)`` (-> seconds,
    result), plus what ``record(name, result)`` adds. ``names[0]`` is the reference: its answer continues
    the conversation, and every other generator must write its tokens. Prints each row's speedups as it goes."""
    rows = []
    for q in first_per_category(load_questions("mt_bench"), per_category):
        messages = [{"role": "user", "content": q["turns"][0]}]
        for turn in (0, 1):
            ids = encode(messages)
            row = {"question_id": q["question_id"], "category": q["category"], "turn": turn}
            for name in names:
                seconds, result = generate(name, ids)
                s = result.stats
                row[name] = {"tokens_per_s": s.new_tokens / seconds, "tau": s.tau, "new_tokens": s.new_tokens}
                row[name] |= record(name, result) if record else {}
                tokens = result.sequences[0, ids.shape[0]:].tolist()
                if name == names[0]:
                    answer, reference = result.text, tokens
                elif tokens != reference:
                    raise RuntimeError(f"question {q['question_id']} turn {turn + 1}: {name} wrote other tokens "
                                       f"than {names[0]}")
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("question_id", "turn")} | {
                name: round(row[name]["tokens_per_s"] / row[names[0]]["tokens_per_s"], 3) for name in names[1:]}),
                flush=True)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": q["turns"][1]}]
    return rows


def timed(gen, ids, max_new_tokens: int) -> tuple[float, object]:
    """(seconds, result) of one ``gen.generate`` call."""
    start = time.perf_counter()
    result = gen.generate(ids, max_new_tokens=max_new_tokens)
    return time.perf_counter() - start, result
