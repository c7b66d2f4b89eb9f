"""Bad input to the commands and the API: one clear line (commands: ``error: ...``, exit 2) or a clear exception, never
a traceback and never silently accepted. One test per kind of bad input; the API's generation arguments, token ids,
context window and roles are in test_generation.py. Commands run in-process (``run_main``) except one subprocess."""

from __future__ import annotations

import builtins
import json
import logging
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from griffin import DraftModel
from griffin.target import file_lock
from tests.conftest import run_main, run_module
from tests.test_features import conversations, write_data
from training.train import split


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_target_dir):
    """A 10-conversation feature store whose held-out conversation has a long prompt (assistant tokens late)."""
    folder = tmp_path_factory.mktemp("bad-store")
    records = conversations(10, words=8)
    held_out = split(10, 0.05)[1][0]
    records[held_out]["conversations"][0]["value"] += " long" * 60
    data = write_data(folder / "d.json", records)
    code, err = run_main("training.build_features", "--target", str(tiny_target_dir), "--data", data, "--out",
                         str(folder / "store"), "--max-len", "160", "--shard-size", "4")
    assert code == 0, err
    return folder / "store"


def copy_of(folder, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(folder, dst)
    return dst


def check(module: str, *args: str, message: str) -> None:
    code, err = run_main(module, *args)
    assert code == 2, err
    assert message in err, err
    assert "Traceback" not in err


# --- files that are damaged or not what they claim to be -------------------------------------------------------------


def test_truncated_or_corrupted_head_weights_name_the_file(tmp_path, head_dir):
    head = copy_of(head_dir, tmp_path)
    weights = head / "model.safetensors"
    data = weights.read_bytes()
    for broken in (data[: len(data) // 2], b"not a safetensors file", b""):
        weights.write_bytes(broken)
        with pytest.raises(ValueError, match=f"{weights} is truncated or corrupted"):
            DraftModel.from_pretrained(head)
    check("training.export", str(head), str(tmp_path / "out"), message="model.safetensors is truncated or corrupted")
    official = tmp_path / "official"
    official.mkdir()
    shutil.copyfile("tests/fixtures/official-eagle/config.json", official / "config.json")
    (official / "pytorch_model.bin").write_bytes(b"\x80\x02 truncated pickle")
    with pytest.raises(ValueError, match="pytorch_model.bin is truncated, corrupted or not a plain state dict"):
        DraftModel.from_pretrained(official)


def test_a_head_config_with_invalid_json_or_missing_fields_names_the_file_and_the_field(tmp_path, head_dir):
    head = copy_of(head_dir, tmp_path)
    config = head / "config.json"
    good = json.loads(config.read_text())
    config.write_text('{"hidden_size": 32,\n "arch": }')
    with pytest.raises(ValueError, match=rf"{config} is not valid JSON \(Expecting value at line 2, column 10\)"):
        DraftModel.from_pretrained(head)
    config.write_text(json.dumps({k: v for k, v in good.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match=rf"{config}: missing fields \['hidden_size'\]"):
        DraftModel.from_pretrained(head)
    for field, value in (("hidden_size", "32"), ("num_attention_heads", 0), ("vocab_size", None)):
        config.write_text(json.dumps(good | {field: value}))
        with pytest.raises(ValueError, match=f"{config}: field '{field}' must be a positive integer"):
            DraftModel.from_pretrained(head)
    config.write_text(json.dumps(good | {"rope_parameters": {}}))
    with pytest.raises(ValueError, match="field 'rope_parameters' must be a dict with 'rope_theta'"):
        DraftModel.from_pretrained(head)
    config.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not a head config object"):
        DraftModel.from_pretrained(head)
    check("training.export", str(head), str(tmp_path / "out"), message="holds a JSON list")
    official = copy_of("tests/fixtures/official-griffin", tmp_path, "official")
    raw = json.loads((official / "config.json").read_text())
    (official / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "num_attention_heads"}))
    with pytest.raises(ValueError, match="an official griffin config.*field 'num_attention_heads' must be a positive"):
        DraftModel.from_pretrained(official)


def test_a_truncated_feature_shard_is_named_and_rebuilt_by_the_rerun(tmp_path, store, tiny_target_dir, caplog):
    broken = copy_of(store, tmp_path)
    shard = broken / "shard-00001.safetensors"
    original = shard.read_bytes()
    shard.write_bytes(original[: len(original) // 3])
    check("training.train", "--features", str(broken), "--out", str(tmp_path / "head"),
          message=f"feature shard {shard} is truncated or corrupted")
    build = json.loads((broken / "build.json").read_text())
    code, err = run_main("training.build_features", "--target", str(tiny_target_dir), "--data", build["data"],
                         "--out", str(broken), "--max-len", "160", "--shard-size", "4")
    assert code == 0, err
    assert f"feature shard {shard} is truncated or corrupted" in caplog.text and "rebuilding it" in caplog.text
    rebuilt, reference = load_file(str(shard)), load_file(str(store / "shard-00001.safetensors"))
    assert rebuilt.keys() == reference.keys() and all(torch.equal(rebuilt[k], reference[k]) for k in reference)
    save_file({"x": torch.zeros(2)}, str(shard))  # a readable file that is not a shard
    check("training.train", "--features", str(broken), "--out", str(tmp_path / "head"),
          message="is not a feature shard")
    (broken / "manifest.json").write_text("{")
    check("training.train", "--features", str(broken), "--out", str(tmp_path / "head"),
          message="manifest.json is not valid JSON")


# --- output folders ----------------------------------------------------------------------------------------------


def test_an_out_that_is_a_file_or_not_writable_is_refused_before_any_work(tmp_path, store, tiny_target_dir):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for module, args in (("training.build_features", ["--target", str(tiny_target_dir)]),
                         ("training.train", ["--features", str(store)])):
        check(module, *args, "--out", str(a_file), message=f"--out {a_file} is a file, not a folder")
        check(module, *args, "--out", str(a_file / "sub"),
              message=f"--out {a_file / 'sub'} is not writable (a parent is a file)")
    assert a_file.read_text() == "x"


# --- flags that would be accepted but ignored or misread ---------------------------------------------------------


@pytest.mark.parametrize("module,args,message", [
    ("training.train", ["--lr", "0"], "argument --lr: must be a number > 0, got '0'"),
    ("training.train", ["--lr", "-0.0001"], "argument --lr: must be a number > 0"),
    ("training.train", ["--lr", "nan"], "argument --lr: must be a number > 0"),
    ("training.train", ["--max-len", "0"], "argument --max-len: must be an integer >= 1"),
    ("training.train", ["--max-len", "1"], "argument --max-len: must be at least 2"),
    ("training.train", ["--save-every", "0"], "argument --save-every: must be an integer >= 1"),
    ("training.train", ["--save-every", "-5"], "argument --save-every: must be an integer >= 1"),
    ("training.train", ["--val-max", "0"], "argument --val-max: must be an integer >= 1"),
    ("training.train", ["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
    ("training.train", ["--grad-clip", "-1"], "argument --grad-clip: must be a finite number >= 0"),
    ("training.train", ["--val-fraction", "1"], "argument --val-fraction: must be a number in (0, 1)"),
    ("training.build_features", ["--max-samples", "0"], "argument --max-samples: must be an integer >= 1"),
    ("training.build_features", ["--max-len", "-3"], "argument --max-len: must be an integer >= 1"),
    ("inference.speed", ["--limit", "0"], "argument --limit: must be an integer >= 1"),
    ("inference.speed", ["--limit", "-2"], "argument --limit: must be an integer >= 1"),
    ("inference.speed", ["--total-tokens", "-1"], "argument --total-tokens: must be 'auto' or an integer >= 0"),
    ("benchmarks.loop_overhead", ["--rounds", "0"], "argument --rounds: must be an integer >= 1"),
    ("inference.demo", ["--total-tokens", "big"], "argument --total-tokens: must be 'auto' or an integer >= 0"),
    ("inference.demo", ["--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1"),
    ("inference.chat", ["--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
    ("inference.chat", ["--temperature", "-0.5"], "argument --temperature: must be a finite number >= 0"),
    ("inference.chat", ["--top-p", "1.5"], "argument --top-p: must be a number in (0, 1]"),
])
def test_zero_negative_or_non_finite_flags_are_refused(module, args, message, tmp_path):
    required = {"training.train": ["--features", str(tmp_path), "--out", str(tmp_path / "o")],
                "training.build_features": ["--out", str(tmp_path / "o")]}.get(module, [])
    code, err = run_main(module, *required, *args)
    assert code == 2 and message in err, err
    assert not (tmp_path / "o").exists()  # refused before anything was created


def test_a_topk_beyond_the_draft_vocabulary_or_a_max_len_beyond_the_store_is_refused(tmp_path, store):
    base = ["--features", str(store), "--max-updates", "1", "--batch-size", "2"]
    check("training.train", *base, "--out", str(tmp_path / "a"), "--draft-vocab", "300", "--topk", "301",
          message="--topk 301 is larger than the head's draft vocabulary (300 tokens)")
    check("training.train", *base, "--out", str(tmp_path / "b"), "--max-len", "500",
          message="--max-len 500 is longer than the conversations in")
    check("training.train", *base, "--out", str(tmp_path / "c"), "--max-len", "2",
          message="has an assistant token within --max-len 2: there is nothing to train on")


def test_validation_that_measures_nothing_reports_no_numbers(tmp_path, store, caplog):
    caplog.set_level(logging.WARNING)
    out = tmp_path / "head"
    code, err = run_main("training.train", "--features", str(store), "--out", str(out), "--max-len", "80",
                         "--max-updates", "1", "--batch-size", "2")
    assert code == 0, err
    passes = json.loads((out / "validation.json").read_text())["epochs"][-1]["passes"]
    assert [(p["loss"], p["top1"], p["positions"]) for p in passes] == [(None, None, 0)] * len(passes)
    assert "validation after epoch 0 measured nothing" in caplog.text


def test_a_resume_with_other_flags_is_refused(tmp_path, store):
    args = ["--features", str(store), "--out", str(tmp_path / "h"), "--batch-size", "2", "--max-updates", "3",
            "--save-every", "1"]
    code, err = run_main("training.train", *args, "--lr", "1e-3")
    assert code == 0, err
    shutil.rmtree(tmp_path / "h" / "validation.json", ignore_errors=True)
    check("training.train", *args, "--lr", "2e-3", "--resume",
          message="holds a run started with other settings (lr: 0.001 then, 0.002 now)")


# --- runs that fail, and runs that collide ---------------------------------------------------------------------------


def test_a_failed_build_leaves_its_out_usable_for_the_corrected_rerun(tmp_path, tiny_target_dir):
    data = write_data(tmp_path / "d.json", conversations(3))
    out = ["--target", str(tiny_target_dir), "--out", str(tmp_path / "s")]
    check("training.build_features", *out, "--data", data, "--max-len", "8", message="every record was skipped")
    check("training.build_features", *out, "--data", str(tmp_path / "missing.json"),
          message="cannot read training data")
    code, err = run_main("training.build_features", *out, "--data", data, "--max-len", "160")
    assert code == 0, err
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["num_samples"] == 3
    check("training.build_features", *out, "--data", data, "--max-len", "150",
          message="was built with other settings (max_len differ)")  # once it holds conversations: refused


def test_two_builds_into_one_folder_take_turns_and_two_trainings_are_refused(tmp_path, store, tiny_target_dir,
                                                                            caplog):
    caplog.set_level(logging.INFO)
    from training import build_features

    out = tmp_path / "s"
    out.mkdir()
    data = write_data(tmp_path / "d.json", conversations(3))
    results: list[int] = []
    args = ["--target", str(tiny_target_dir), "--data", data, "--out", str(out), "--max-len", "160"]
    with file_lock(out / ".lock"):  # another build holds the folder
        thread = threading.Thread(target=lambda: results.append(build_features.main(args)))
        thread.start()
        deadline = time.time() + 120
        while "waiting for it to finish" not in caplog.text and time.time() < deadline:
            time.sleep(0.05)
        assert "waiting for it to finish" in caplog.text
        assert not (out / "build.json").exists()  # nothing written while the other build holds the folder
    thread.join(timeout=300)
    assert results == [0] and (out / "manifest.json").is_file()
    with file_lock(tmp_path / "h" / ".lock"):
        check("training.train", "--features", str(store), "--out", str(tmp_path / "h"),
              message=f"another training run is writing into {tmp_path / 'h'}")


# --- chat ----------------------------------------------------------------------------------------------------------


def scripted_input(monkeypatch, lines: list):
    """``input()`` returns these lines in turn; an exception instance is raised instead (e.g. KeyboardInterrupt)."""
    queue = list(lines)

    def fake(prompt=""):
        item = queue.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    monkeypatch.setattr(builtins, "input", fake)


def test_ctrl_c_in_chat_keeps_the_conversation_and_says_how_to_continue_it(tmp_path, tiny_target_dir, head_dir,
                                                                         monkeypatch, capsys):
    from griffin import SpecGenerator
    from inference import chat

    save = tmp_path / "chat.json"
    args = ["--target", str(tiny_target_dir), "--draft", str(head_dir), "--total-tokens", "4", "--max-new-tokens",
            "6", "--save", str(save)]
    scripted_input(monkeypatch, ["Hello there", KeyboardInterrupt()])  # Ctrl-C at the prompt
    assert chat.main(args) == 130
    saved = json.loads(save.read_text())["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"] and saved[0]["content"] == "Hello there"
    assert f"continue it with: python -m inference.chat --resume {save}" in capsys.readouterr().out

    stream = SpecGenerator.stream

    def interrupted(self, *a, **k):  # Ctrl-C in the middle of a reply
        for i, piece in enumerate(stream(self, *a, **k)):
            if i == 2:
                raise KeyboardInterrupt
            yield piece

    monkeypatch.setattr(SpecGenerator, "stream", interrupted)
    scripted_input(monkeypatch, ["And then?", ""])
    assert chat.main([*args[:-2], "--resume", str(save)]) == 0
    out = capsys.readouterr().out
    assert "[continuing" in out and "reply stopped; it stays in the conversation" in out
    saved = json.loads(save.read_text())["messages"]
    assert [m["content"] for m in saved if m["role"] == "user"] == ["Hello there", "And then?"]
    assert len(saved) == 4 and saved[-1]["role"] == "assistant"
    save.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}))
    check("inference.chat", *args[:-2], "--resume", str(save), message="role 'robot', which chat templates do not "
                                                                      "know")


# --- one real process ----------------------------------------------------------------------------------------------


def test_a_real_process_prints_one_error_line_and_no_traceback(tmp_path, store):
    broken = copy_of(store, tmp_path)
    (broken / "shard-00000.safetensors").write_bytes(b"\x00" * 16)
    res = run_module("training.train", "--features", str(broken), "--out", str(tmp_path / "h"))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "shard-00000.safetensors is truncated or corrupted" in errors[0], res.stderr
    assert res.stderr.rstrip().endswith(errors[0])


def test_evaluate_scores_every_conversation_and_names_a_folder_that_is_no_head(tmp_path, store, head_dir):
    out = tmp_path / "report.json"
    code, err = run_main("training.evaluate", str(head_dir), "--features", str(store), "--steps", "2", "--out",
                         str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["conversations"] == 10 and [p["pass"] for p in report["passes"]] == [1, 2]
    assert 0 <= report["passes"][0]["top1"] <= 1 and report["passes"][0]["kept"] == 1.0
    check("training.evaluate", str(tmp_path), "--features", str(store), message="is not a head folder")
    check("training.evaluate", str(head_dir), "--features", str(tmp_path), message="is not a feature store")
