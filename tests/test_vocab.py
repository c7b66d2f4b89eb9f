"""Widening a trained head's draft vocabulary (``training.vocab``): the ranking, the kept scores, the new rows, and the
commands around it."""

from __future__ import annotations

import json

import pytest
import torch

from griffin.config import DraftConfig
from griffin.draft import DraftModel
from tests.conftest import run_main, tiny_model
from tests.test_features import conversations, write_data
from training.vocab import grow, rank_tokens


class Characters:
    """A tokenizer whose ids are character codes (< 128)."""

    def __len__(self) -> int:
        return 128

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def test_tokens_rank_by_their_count_in_assistant_turns_with_eos_first():
    records = [{"conversations": [{"from": "human", "value": "zzzz"}, {"from": "gpt", "value": "aab"}]},
               {"conversations": [{"from": "human", "value": "zq"}, {"from": "gpt", "value": "ca"}]},
               "not a conversation"]
    ranked, counts = rank_tokens(Characters(), records, eos_id=0)
    assert ranked[:4].tolist() == [0, ord("a"), ord("b"), ord("c")]
    assert counts[:4].tolist() == [4, 3, 1, 1] and int((counts > 0).sum()) == 4  # the user's z and q do not count


def fused_head(old: torch.Tensor) -> tuple[DraftModel, torch.Tensor]:
    """An eagle3 head for a tiny target (vocabulary 128, hidden 32) with draft vocabulary ``old``, whose lm_head rows
    are an exact affine image of the target's rows; and the target's lm_head [128, 32]."""
    target = tiny_model(hidden=32)
    head = DraftModel(DraftConfig.from_target(target.config, arch="eagle3", draft_vocab_size=len(old)))
    theirs = target.lm_head.weight.detach()
    torch.manual_seed(1)
    carry, bias = torch.randn(32, 32) / 6, torch.randn(32) / 6
    with torch.no_grad():
        head.draft_vocab.copy_(old)
        head.lm_head.weight.copy_(theirs[old] @ carry + bias)
    return head, theirs


def test_widening_keeps_every_kept_score_and_carries_the_targets_rows_into_the_heads_space():
    old = torch.arange(0, 128, 2)  # 64 even ids: more rows than the 33 unknowns of the map per column
    head, theirs = fused_head(old)
    x = torch.randn(5, 32)
    before = head.lm_head(x)
    ranked = torch.cat((torch.tensor([3, 4, 5, 9, 7]), torch.arange(128).flip(0)))  # 4 is kept already
    added = grow(head, ranked, 80, theirs)
    assert added.tolist() == [3, 5, 9, 7, *range(127, 103, -2)]  # best first, skipping the kept ids
    vocab = head.draft_vocab
    assert head.config.draft_vocab_size == 80 and head.lm_head.weight.shape == (80, 32)
    assert torch.equal(vocab, vocab.sort().values) and set(vocab.tolist()) == set(old.tolist()) | set(added.tolist())
    kept = torch.isin(vocab, old)
    torch.testing.assert_close(head.lm_head(x)[:, kept], before, rtol=0, atol=0)  # kept scores: exactly the same
    torch.manual_seed(1)  # the affine map fused_head drew: the new rows follow it
    carry, bias = torch.randn(32, 32) / 6, torch.randn(32) / 6
    torch.testing.assert_close(head.lm_head.weight[~kept], theirs[vocab[~kept]] @ carry + bias, rtol=1e-4, atol=1e-4)


def test_widening_refuses_what_it_cannot_do():
    head, theirs = fused_head(torch.arange(0, 128, 2))
    with pytest.raises(ValueError, match="not cut"):
        grow(head, torch.arange(128), 32, theirs)
    with pytest.raises(ValueError, match="names only 2 tokens the head lacks, 16 are needed"):
        grow(head, torch.tensor([0, 1, 3]), 80, theirs)
    with pytest.raises(ValueError, match="larger than the target's vocabulary"):
        grow(head, torch.arange(128), 129, theirs)
    full = DraftModel(DraftConfig.from_target(tiny_model(hidden=32).config, arch="eagle3"))
    with pytest.raises(ValueError, match="full vocabulary"):
        grow(full, torch.arange(128), 64, theirs)


def test_a_widened_head_saves_loads_and_trains_on(tmp_path, tiny_target_dir):
    """vocab widens a trained eagle3 head; train continues it at the new size, and refuses a size that is not its
    own with one line naming the command that widens."""
    data = write_data(tmp_path / "data.json", conversations(10))
    store = tmp_path / "store"
    assert run_main("training.build_features", "--out", str(store), "--target", str(tiny_target_dir), "--data", data,
                    "--max-len", "256", "--feature-layers", "auto")[0] == 0
    train = ["--features", str(store), "--max-updates", "1", "--batch-size", "2", "--ttt-steps", "2",
             "--arch", "eagle3"]
    assert run_main("training.train", *train, "--draft-vocab", "64", "--out", str(tmp_path / "e3"))[0] == 0
    code, err = run_main("training.vocab", str(tmp_path / "e3"), "--size", "96", "--out", str(tmp_path / "wide"),
                         "--target", str(tiny_target_dir), "--data", data)
    assert code == 0, err
    small, wide = DraftModel.from_pretrained(tmp_path / "e3"), DraftModel.from_pretrained(tmp_path / "wide")
    assert wide.config.draft_vocab_size == 96 and torch.isin(small.draft_vocab, wide.draft_vocab).all()
    kept = torch.isin(wide.draft_vocab, small.draft_vocab)
    assert torch.equal(wide.lm_head.weight[kept], small.lm_head.weight)
    code, err = run_main("training.train", *train, "--init-from", str(tmp_path / "wide"), "--out", str(tmp_path / "x"),
                         "--draft-vocab", "64")
    assert code == 2 and "python -m training.vocab" in err and len(err.strip().splitlines()) == 1
    assert run_main("training.train", *train, "--init-from", str(tmp_path / "wide"), "--draft-vocab", "96", "--out",
                    str(tmp_path / "on"))[0] == 0
    assert json.loads((tmp_path / "on" / "validation.json").read_text())["run"]["draft_vocab"] == 96
    code, err = run_main("training.vocab", str(tmp_path / "e3"), "--size", "32", "--out", str(tmp_path / "cut"),
                         "--target", str(tiny_target_dir), "--data", data)
    assert code == 2 and "not cut" in err
