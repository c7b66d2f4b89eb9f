"""Tokenizer compatibility of a draft LM: refused fast with the first difference named, accepted when only roles or
logits padding differ."""

from __future__ import annotations

import json
import time

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from griffin.compat import TokenizerMismatch, check_compatible
from tests.conftest import tiny_model


def edited_copy(tokenizer, edit=None, **special) -> PreTrainedTokenizerFast:
    """A copy of ``tokenizer`` built from its tokenizer.json after ``edit(json_dict)``."""
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    if edit:
        edit(data)
    roles = {"eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token}
    copy = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), **{**roles, **special})
    copy.chat_template = tokenizer.chat_template
    return copy


# CPU time, not wall time: the bound is about the check's cost, which a busy shared machine must not blur
def refused(target_tok, draft_tok, match: str, **models_) -> str:
    t0 = time.process_time()
    with pytest.raises(TokenizerMismatch, match=match) as err:
        check_compatible(target_tok, draft_tok, **models_)
    assert time.process_time() - t0 < 1.0
    return str(err.value)


def test_identical_tokenizers_pass_in_under_a_second(smol_tokenizer):
    copy = edited_copy(smol_tokenizer)
    t0 = time.process_time()
    check_compatible(smol_tokenizer, copy)
    assert time.process_time() - t0 < 1.0


def test_a_tiny_model_with_its_own_tokenizer_is_refused(smol_tokenizer):
    words = ["[UNK]", "<|im_end|>", "hello", "world", "!"] + [f"w{i}" for i in range(59)]
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="[UNK]", eos_token="<|im_end|>")
    draft = tiny_model("llama", vocab_size=len(other))
    message = refused(smol_tokenizer, other, "vocabulary size differs", draft_model=draft)
    assert "49152" in message and "64" in message


def test_a_renamed_special_token_is_named(smol_tokenizer):
    def rename(data):
        for entry in data["added_tokens"]:
            if entry["content"] == "<|im_start|>":
                entry["content"] = "<|turn|>"
        vocab = data["model"]["vocab"]
        vocab["<|turn|>"] = vocab.pop("<|im_start|>")

    message = refused(smol_tokenizer, edited_copy(smol_tokenizer, rename), "special token")
    assert "'<|im_start|>' is id 1 in the target's tokenizer but absent in the draft's" in message


def test_swapped_ordinary_tokens_are_named(smol_tokenizer):
    def swap(data):
        vocab = data["model"]["vocab"]
        vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]

    message = refused(smol_tokenizer, edited_copy(smol_tokenizer, swap), "vocabulary differs")
    assert "'hello'" in message or "'world'" in message


def test_a_different_normaliser_is_caught_by_the_sample_encodings(smol_tokenizer):
    def lowercase(data):
        data["normalizer"] = {"type": "Lowercase"}

    message = refused(smol_tokenizer, edited_copy(smol_tokenizer, lowercase), "encode 'Hello, world!")
    assert "token 0" in message


def test_different_roles_over_the_same_ids_are_accepted(smol_tokenizer):
    # a base draft (EOS <|endoftext|>) for an instruct target (EOS <|im_end|>): same ids, the target decides stopping
    check_compatible(smol_tokenizer, edited_copy(smol_tokenizer, eos_token="<|endoftext|>"))


def test_logits_narrower_than_the_vocabulary_are_refused(smol_tokenizer):
    narrow = tiny_model("llama", vocab_size=1000)
    message = refused(smol_tokenizer, smol_tokenizer, "draft model's logits are 1000 wide", draft_model=narrow)
    assert "49152" in message
