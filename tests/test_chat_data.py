"""Chat templates with assistant-only loss masks, and reading ShareGPT data."""

from __future__ import annotations

import copy
import json

import pytest

from griffin.chat_template import BUILTIN_TEMPLATES, TemplateError, set_chat_template, tokenize_conversation
from training.data import BadConversation, DataError, iter_json_records, iter_records, to_messages

CONV = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue is a colour."},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "Green."},
]
END_MARK = {"chatml": "<|im_end|>", "llama-2": "</s>", "llama-3": "<|eot_id|>", "vicuna": "</s>", None: "<|im_end|>"}


@pytest.mark.parametrize("template", ["chatml", "llama-2", "llama-3", "vicuna", None])
def test_loss_mask_covers_exactly_the_assistant_turns(smol_tokenizer, template):
    tok = copy.deepcopy(smol_tokenizer)
    # the special tokens of each family are single tokens in its own tokenizer
    tok.add_special_tokens({"additional_special_tokens": ["<s>", "</s>", "<|begin_of_text|>", "<|eot_id|>",
                                                         "<|start_header_id|>", "<|end_header_id|>"]})
    if template in ("llama-2", "vicuna"):
        tok.bos_token, tok.eos_token = "<s>", "</s>"
    elif template == "llama-3":
        tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    set_chat_template(tok, template)
    ids, mask = tokenize_conversation(tok, CONV)
    runs, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist()):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    texts = [tok.decode(r).strip() for r in runs]
    assert len(texts) == 2, texts
    for text, answer in zip(texts, ["Blue is a colour.", "Green."]):
        assert text.startswith(answer), text
        assert text[len(answer):].strip() == END_MARK[template], text  # the end-of-turn marker is learned too
    user_tokens = tok.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if not m])
    assert "Name a colour." in user_tokens and "Another one?" in user_tokens
    assert "Blue" not in user_tokens


def test_truncation_keeps_mask_aligned(smol_tokenizer):
    ids, mask = tokenize_conversation(smol_tokenizer, CONV)
    ids8, mask8 = tokenize_conversation(smol_tokenizer, CONV, max_len=8)
    assert ids8.tolist() == ids[:8].tolist() and mask8.tolist() == mask[:8].tolist()


def test_template_errors(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    with pytest.raises(TemplateError, match="unknown chat template"):
        set_chat_template(tok, "nope")
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        set_chat_template(tok, None)
    # a template that drops earlier turns is not prefix-stable
    tok.chat_template = "{{ messages[-1]['content'] }}"
    with pytest.raises(TemplateError, match="prefix by prefix"):
        tokenize_conversation(tok, CONV)
    assert set(BUILTIN_TEMPLATES) == {"chatml", "llama-2", "llama-3", "vicuna"}


def sharegpt(*turns):
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_to_messages_validation():
    ok = to_messages(sharegpt(("system", "be nice"), ("human", "hi"), ("gpt", "hello"), ("human", "unanswered")))
    assert [m["role"] for m in ok] == ["system", "user", "assistant"]
    # a continuation record: the answer whose question is in the previous record is dropped
    cont = to_messages(sharegpt(("system", "s"), ("gpt", "rest of an answer"), ("human", "q"), ("gpt", "a")))
    assert [(m["role"], m["content"]) for m in cont] == [("system", "s"), ("user", "q"), ("assistant", "a")]
    cases = [
        ("empty", sharegpt(("gpt", "hello"), ("human", "hi"))),  # nothing answered is left
        ("empty", sharegpt()),
        ("empty", sharegpt(("gpt", "the end of an answer"))),
        ("not_alternating", sharegpt(("gpt", "x"), ("gpt", "y"), ("human", "b"), ("gpt", "c"))),
        ("not_alternating", sharegpt(("human", "a"), ("human", "b"), ("gpt", "c"))),
        ("malformed", sharegpt(("human", "a"), ("robot", "b"))),
        ("malformed", {"id": 1}),
    ]
    for reason, record in cases:
        with pytest.raises(BadConversation) as err:
            to_messages(record)
        assert err.value.reason == reason
    with pytest.raises(BadConversation, match="empty"):
        to_messages(sharegpt(("human", "hi"), ("gpt", "  ")))


def test_truncated_json_list_yields_complete_records(tmp_path):
    records = [sharegpt(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(50)]
    text = json.dumps(records, indent=1)
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) - 40])  # cut inside the last record
    got = list(iter_json_records(path, chunk_chars=64))  # tiny chunks exercise the refill path
    assert got == records[:49]
    path.write_text(text)
    assert list(iter_records(path)) == records


def test_unreadable_data_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("this is not json")
    with pytest.raises(DataError, match="not a JSON list"):
        list(iter_records(path))
    path.write_text("[{broken")
    with pytest.raises(DataError, match="not valid JSON"):
        list(iter_records(path))
    with pytest.raises(DataError, match="cannot read training data"):
        list(iter_records(tmp_path / "missing-folder"))
