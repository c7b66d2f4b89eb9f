"""The evaluation question sets (vendored under ``inference/data``; never used for training).

``BENCHES`` are the three sets the papers report on (``--bench all``); ``EXTRA_BENCHES`` are task types beyond them
(translation, summarisation, question answering over a passage), written for this project.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
BENCHES = ("mt_bench", "humaneval", "gsm8k")
EXTRA_BENCHES = ("extra_tasks",)


def load_questions(bench: str, limit: int | None = None) -> list[dict]:
    """Questions of a bench: ``question_id``, ``category``, ``turns`` (user turns)."""
    if bench not in BENCHES + EXTRA_BENCHES:
        raise ValueError(f"unknown bench {bench!r}: choose from {', '.join(BENCHES + EXTRA_BENCHES)} or all")
    lines = (DATA / bench / "question.jsonl").read_text().splitlines()
    questions = [json.loads(line) for line in lines if line.strip()]
    return questions[:limit] if limit else questions


def first_per_category(questions: list[dict], n: int) -> list[dict]:
    """The first ``n`` questions of each category, in their order."""
    seen: Counter = Counter()
    kept = []
    for question in questions:
        seen[question.get("category")] += 1
        if seen[question.get("category")] <= n:
            kept.append(question)
    return kept
