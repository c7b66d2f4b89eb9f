"""τ of each head on MT-Bench's first and second turns apart, from the τ files already here (nothing is rerun).

A second turn's context holds the target's own first answer, the text the recipe's answers chunks train on; the
shipped heads also propose the tokens of the context (``context_vocab``), which a second turn has more of. So the
turn-2 − turn-1 difference says whether second turns are where the new heads lose, and whether the context
vocabulary is where the shipped heads gain.

    python benchmarks/results/recipe3-tau/by-turn.py

Writes ``by-turn.{json,md}`` beside this file. Turns are different prompts, so their difference is not paired: its
standard error is the two pooled τ's errors combined.
"""

import json
import math
from pathlib import Path

from griffin.report import markdown_table, paired_difference, pooled_tau, write_benchmark

HERE = Path("benchmarks/results/recipe3-tau")  # run from the repository root
LINEAGES = ["griffin-c01", "griffin-c04", "griffin-c09", "griffin-c18", "griffin-c25", "smollm2-135m-instruct-griffin",
             "eagle2-c01", "eagle2-c04", "eagle2-c09", "eagle2-c18", "eagle2-c25", "smollm2-135m-instruct-eagle2"]
# (file, the head's key in it, the row's label)
SOURCES = [*((f"chunk-{n}-160", f"work/recipe3/runs/{h}/chunk-0{n}", f"{h} after chunk {n}")
             for n in (11, 13, 15, 16, 17) for h in ("eagle3", "griffin3")),
           ("chunk-17", "chunk-017", "eagle3 after chunk 17"),
           ("chunk-17-griffin3", "chunk-017", "griffin3 after chunk 17"),
           *(("shipped-curve", h, h.replace("smollm2-135m-instruct-", "shipped ")) for h in LINEAGES),
           ("context-vocab", "griffin-static", "shipped griffin without context_vocab (griffin-static)")]
# eagle3 after chunk 17 against heads of the shipped lineages, on the same 80 prompts: (file, key, label)
PAIRED_WITH = [("shipped-curve", "eagle2-c18", "eagle2-c18"), ("shipped-curve", "griffin-c18", "griffin-c18"),
               ("shipped-curve", "smollm2-135m-instruct-griffin", "shipped griffin"),
               ("context-vocab", "griffin-static", "griffin-static")]


def prompts_of(stem: str, key: str) -> list[dict]:
    return json.loads((HERE / f"{stem}.json").read_text())["heads"][key]["0"]["per_prompt"]


def main() -> None:
    rows, records = [], []
    for stem, path, name in SOURCES:
        prompts = prompts_of(stem, path)
        turns = [pooled_tau([p for p in prompts if p["turn"] == t]) for t in (0, 1)]
        diff = turns[1]["tau"] - turns[0]["tau"]
        se = math.hypot(turns[0]["se"], turns[1]["se"])
        records.append({"file": f"{stem}.json", "head": path, "turn_1": turns[0], "turn_2": turns[1],
                        "turn_2_minus_turn_1": {"diff": diff, "se": se}})
        rows.append([name, f"[{stem}]({stem}.md)", turns[0]["n_prompts"] + turns[1]["n_prompts"],
                     f"{turns[0]['tau']:.2f} ± {turns[0]['se']:.2f}", f"{turns[1]['tau']:.2f} ± {turns[1]['se']:.2f}",
                     f"{diff:+.3f} ± {se:.3f}"])
    table = markdown_table(["head", "file", "prompts", "τ turn 1", "τ turn 2", "turn 2 − turn 1"], rows)
    mine, paired, lines = prompts_of("chunk-17", "chunk-017"), [], []
    for stem, key, name in PAIRED_WITH:
        theirs = prompts_of(stem, key)
        diffs = [paired_difference([p for p in mine if p["turn"] == t], [p for p in theirs if p["turn"] == t])
                 for t in (0, 1)]
        paired.append({"other": f"{stem}.json: {key}", "turn_1": diffs[0], "turn_2": diffs[1]})
        lines.append([name, *(f"{d['diff']:+.3f} ± {d['se']:.3f} ({d['n_prompts']})" for d in diffs)])
    table += ("\n\neagle3 after chunk 17 ([chunk-17](chunk-17.md)) minus another head, paired over the prompts of one "
              "turn (count in brackets):\n\n" + markdown_table(["other head", "turn 1", "turn 2"], lines))
    markdown = ("# τ by MT-Bench turn (issue 33)\n\nPooled τ (`griffin.report.pooled_tau`) of each head's first-turn "
                "and second-turn prompts, MT-Bench T=0 on the fixed 24-node tree, read from the τ files named in the "
                "table (each file's own command is in its `.md`).\n\n" + table +
                "\n\nCommand: `python benchmarks/results/recipe3-tau/by-turn.py`\n")
    write_benchmark(HERE, "by-turn", {"command": "python benchmarks/results/recipe3-tau/by-turn.py", "rows": records,
                                      "eagle3_chunk_17_minus": paired},
                    markdown)


if __name__ == "__main__":
    main()
