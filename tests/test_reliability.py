"""Reliable under real use: streams that end mid-character, threads sharing a generator, damaged or unusable caches
and target folders, device strings, cut JSONL lines and output folders that hold another artefact."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from griffin import SpecGenerator
from tests.conftest import tiny_model
from tests.test_generation import NoTokenizer, untrained_head

# replies in scripts whose characters take several tokens of SmolLM2's byte-level BPE; budgets that cut the last
# character (the text of generate then ends in U+FFFD) and budgets that do not
MULTI_TOKEN_PROMPTS = {
    "emoji": "Reply with exactly five emoji and nothing else: 🎉🎉🎉🎉🎉",
    "hangul": "Say hello in Korean.",
    "cjk": "Translate to Chinese: I love my family.",
    "devanagari": "Translate to Hindi: thank you",
}


@pytest.fixture(scope="module")
def shipped_generator():
    return SpecGenerator.from_pretrained(total_tokens=6)


@pytest.mark.parametrize("script", sorted(MULTI_TOKEN_PROMPTS))
def test_a_joined_stream_is_the_generated_text_also_when_it_ends_inside_a_character(shipped_generator, script):
    messages = [{"role": "user", "content": MULTI_TOKEN_PROMPTS[script]}]
    texts = []
    for budget in (5, 11, 16):
        text = shipped_generator.generate(messages, max_new_tokens=budget).text
        assert "".join(shipped_generator.stream(messages, max_new_tokens=budget)) == text
        texts.append(text)
    assert any(ord(c) > 0x7F for t in texts for c in t)  # the reply really is in that script


def test_two_threads_on_one_generator_take_turns_and_get_their_own_outputs():
    target = tiny_model("llama", vocab_size=96, seed=3)
    # passes of 5 rows: the target's linear layers switch to small-input kernels in each
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=3, top_k=3, total_tokens=4)
    prompts = [torch.tensor([5, 17, 33]), torch.tensor([60, 2, 71, 8, 9])]
    alone = [gen.generate(p, max_new_tokens=24).sequences.tolist() for p in prompts]
    streamed = ["".join(gen.stream(p, max_new_tokens=24)) for p in prompts]
    results: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(i: int) -> None:
        try:
            start.wait()
            for _ in range(6):
                results[i].append(gen.generate(prompts[i], max_new_tokens=24).sequences.tolist())
                results[i].append("".join(gen.stream(prompts[i], max_new_tokens=24)))
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, as a larger target's long passes would
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    for i in (0, 1):
        assert results[i] == [alone[i], streamed[i]] * 6
    assert not gen._busy
