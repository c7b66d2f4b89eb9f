"""Reliable under real use: streams that end mid-character, threads sharing a generator, damaged or unusable caches
and target folders, device strings, cut JSONL lines and output folders that hold another artefact."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from griffin import SpecGenerator, autotune, kernels, target
from griffin.constants import EMBEDDED_TARGET
from tests.conftest import run_main, tiny_model
from tests.test_bad_input import scripted_input
from tests.test_features import conversations, write_data
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


@pytest.mark.parametrize("generators", [1, 2])
def test_two_threads_on_one_target_take_turns_and_get_their_own_outputs(generators):
    """Both threads on one generator, or each on its own generator built on the same loaded target."""
    target = tiny_model("llama", vocab_size=96, seed=3)
    # passes of 5 rows: the target's linear layers switch to small-input kernels in each
    gens = [SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=3, top_k=3, total_tokens=4)
            for _ in range(generators)]
    gens *= 3 - generators
    prompts = [torch.tensor([5, 17, 33]), torch.tensor([60, 2, 71, 8, 9])]
    alone = [gen.generate(p, max_new_tokens=24).sequences.tolist() for gen, p in zip(gens, prompts)]
    streamed = ["".join(gen.stream(p, max_new_tokens=24)) for gen, p in zip(gens, prompts)]
    results: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(i: int) -> None:
        try:
            start.wait()
            for _ in range(6):
                results[i].append(gens[i].generate(prompts[i], max_new_tokens=24).sequences.tolist())
                results[i].append("".join(gens[i].stream(prompts[i], max_new_tokens=24)))
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
    assert not any(gen._busy for gen in gens)


# --- cache records that parse but are wrong: warned about (naming the file and the field) and rebuilt ---------------


@pytest.fixture
def kernel_record(tmp_path, monkeypatch):
    """A tiny model whose kernels were measured once into a fresh cache -> (model, the record's path)."""
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "MEASURE_MIN_BYTES", 0)
    monkeypatch.setattr(kernels, "BUDGET_S", 0.0)
    monkeypatch.setattr(kernels, "_CHOICES", {})
    model = tiny_model("llama")
    kernels.choose_kernels(model)
    [path] = (tmp_path / "kernels").glob("*.json")
    monkeypatch.setattr(kernels, "_CHOICES", {})  # a new process: the file answers
    return model, path


@pytest.mark.parametrize("field, value", [("one_row", "turbo"), ("rows_kernel", "warp"), ("rows_kernel", [1, 2]),
                                          ("rows_kernel", ["weight-major", "turbo"]), ("max_rows", -1),
                                          ("max_rows", "8"), ("max_rows", 1000), ("one_row", None)])
def test_a_kernel_record_with_a_wrong_field_is_named_and_measured_again(kernel_record, field, value, caplog):
    model, path = kernel_record
    record = json.loads(path.read_text())
    path.write_text(json.dumps(record | {field: value}))
    with caplog.at_level(logging.WARNING, logger="griffin.io"):
        choice = kernels.choose_kernels(model)
    assert choice.source == "measured"
    assert str(path) in caplog.text and field in caplog.text and "measuring the kernels again" in caplog.text
    assert kernels.cached_choice(json.loads(path.read_text())).one_row == choice.one_row  # rewritten, valid


def test_a_kernel_record_without_a_field_or_not_an_object_is_measured_again(kernel_record, caplog):
    model, path = kernel_record
    for text in (json.dumps({"one_row": "pad"}), "[1, 2]"):
        path.write_text(text)
        kernels._CHOICES.clear()
        with caplog.at_level(logging.WARNING, logger="griffin.io"):
            assert kernels.choose_kernels(model).source == "measured"
        assert str(path) in caplog.text
    assert "no 'max_rows' field" in caplog.text or "no 'rows_kernel' field" in caplog.text


@pytest.fixture
def tree_record(tmp_path, monkeypatch):
    """A generator on a tiny target and the path of its tuning record in a fresh cache; tuning is replaced by a fixed
    choice (what it measures is tested in test_inference.py)."""
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    target = tiny_model("llama", vocab_size=96, seed=3)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target), depth=3, top_k=3, total_tokens=4)
    monkeypatch.setattr(autotune, "tune", lambda gen, budget_s, temperature: {
        "depth": 4, "top_k": 5, "total_tokens": 12, "temperature": temperature, "reason": "fixed", "tuning_s": 0.0})
    return gen, autotune._record_path(gen, 0.0)


@pytest.mark.parametrize("field, value", [("depth", 0), ("depth", autotune.MAX_DEPTH + 1), ("depth", 2.5),
                                          ("depth", True), ("total_tokens", -1), ("total_tokens", 2.5),
                                          ("total_tokens", "12"), ("total_tokens", None), ("top_k", 0),
                                          ("top_k", -3)])
def test_a_tuning_record_with_a_wrong_field_is_named_and_tuned_again(tree_record, field, value, caplog):
    gen, path = tree_record
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"depth": 3, "top_k": 8, "total_tokens": 6} | {field: value}))
    with caplog.at_level(logging.WARNING, logger="griffin.io"):
        assert autotune.autotune(gen) == (4, 5, 12)
    assert str(path) in caplog.text and field in caplog.text and "tuning again" in caplog.text
    assert json.loads(path.read_text())["total_tokens"] == 12  # rewritten
    assert autotune.tuning_record(gen, 0.0)["depth"] == 4


# --- an unusable cache or converted target folder --------------------------------------------------------------------


@pytest.fixture
def quick_conversion(monkeypatch, tmp_path, smol_tokenizer):
    """The embedded target's conversion into a fresh GRIFFIN_CACHE, from a tiny model instead of the GGUF (seconds)
    -> the folder it converts into, with ``conversions``: how many were made."""
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path / "cache"))
    conversions = []

    def model_from_pretrained(folder, **kwargs):
        if "gguf_file" not in kwargs:  # loading the converted folder
            return AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        conversions.append(folder)
        return tiny_model("llama", vocab_size=len(smol_tokenizer), hidden=32)

    def tokenizer_from_pretrained(folder, **kwargs):
        return smol_tokenizer if "gguf_file" in kwargs else AutoTokenizer.from_pretrained(folder, **kwargs)

    monkeypatch.setattr(target, "AutoModelForCausalLM", SimpleNamespace(from_pretrained=model_from_pretrained))
    monkeypatch.setattr(target, "AutoTokenizer", SimpleNamespace(from_pretrained=tokenizer_from_pretrained))
    return SimpleNamespace(folder=tmp_path / "cache" / "targets" / EMBEDDED_TARGET, conversions=conversions)


def test_atomic_writes_are_readable_by_others_whoever_creates_the_file(tmp_path):
    """safetensors' save_file puts a file of its own (0600) at the temporary path; the written file still gets the
    usual permissions, so that an exported head or a feature shard is readable on a shared server."""
    from safetensors.torch import save_file

    from griffin.io import atomic_write, atomic_write_text

    umask = os.umask(0o022)
    try:
        atomic_write(tmp_path / "model.safetensors", lambda p: save_file({"w": torch.zeros(2)}, str(p)))
        atomic_write_text(tmp_path / "README.md", "card")
    finally:
        os.umask(umask)
    assert {stat.S_IMODE(f.stat().st_mode) for f in tmp_path.iterdir()} == {0o644}


def test_the_converted_target_is_readable_by_others(quick_conversion):
    folder = quick_conversion.folder
    umask = os.umask(0o022)
    try:
        assert target.embedded_target_path() == folder
    finally:
        os.umask(umask)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()} == {0o644}


@pytest.mark.parametrize("missing", ["model.safetensors", "tokenizer.json", "config.json"])
def test_a_converted_target_missing_a_file_is_converted_again(quick_conversion, missing, caplog):
    folder = target.embedded_target_path()
    (folder / missing).unlink()
    with caplog.at_level(logging.WARNING, logger="griffin.target"):
        assert target.embedded_target_path() == folder
    assert (folder / missing).is_file() and len(quick_conversion.conversions) == 2
    assert str(folder) in caplog.text and "converting again" in caplog.text


def test_an_interrupted_conversion_is_cleaned_up_and_converted_again(quick_conversion):
    folder = quick_conversion.folder
    leftover = folder.parent / f".{EMBEDDED_TARGET}-killed"  # what a killed conversion leaves
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    folder.mkdir()  # a target folder that is not complete: os.replace onto it said "Directory not empty"
    (folder / "model.safetensors").write_bytes(b"half")
    assert target.embedded_target_path() == folder
    assert target.embedded_target_path() == folder and len(quick_conversion.conversions) == 1
    assert (folder / "model.safetensors").stat().st_size > 1000
    assert not leftover.exists() and sorted(p.name for p in folder.parent.iterdir()) == [
        f".{EMBEDDED_TARGET}.lock", EMBEDDED_TARGET]


@pytest.mark.parametrize("damage", ["truncated weights", "weights of garbage", "garbage tokenizer", "garbage config"])
def test_a_damaged_converted_target_is_converted_again(quick_conversion, damage, caplog):
    folder = target.embedded_target_path()
    name, text = {"truncated weights": ("model.safetensors", (folder / "model.safetensors").read_bytes()[:1000]),
                  "weights of garbage": ("model.safetensors", b"garbage"),
                  "garbage tokenizer": ("tokenizer.json", b"{"), "garbage config": ("config.json", b"{")}[damage]
    (folder / name).write_bytes(text)
    with caplog.at_level(logging.WARNING, logger="griffin.target"):
        model, tokenizer = target.load_target()
    assert model.config.hidden_size == 32 and tokenizer("hi")["input_ids"]
    assert len(quick_conversion.conversions) == 2 and "converting the embedded target again" in caplog.text
    assert str(folder) in caplog.text


def test_a_cache_that_is_a_file_or_read_only_names_it_and_griffin_cache(quick_conversion, monkeypatch):
    folder = quick_conversion.folder
    cache = folder.parent.parent
    cache.write_text("")  # GRIFFIN_CACHE is a file
    with pytest.raises(ValueError, match=f"{cache}.*set GRIFFIN_CACHE to a writable folder"):
        target.embedded_target_path()
    cache.unlink()

    def read_only(path, wait=True):
        raise PermissionError(13, "Permission denied", str(path))  # a read-only folder (root may write any folder)

    monkeypatch.setattr(target, "file_lock", read_only)
    with pytest.raises(ValueError, match=f"{folder} \\(Permission denied\\): set GRIFFIN_CACHE"):
        target.embedded_target_path()


def test_choices_that_cannot_be_cached_hold_in_memory(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(kernels, "MEASURE_MIN_BYTES", 0)
    monkeypatch.setattr(kernels, "BUDGET_S", 0.0)
    monkeypatch.setattr(kernels, "_CHOICES", {})
    model = tiny_model("llama")
    with caplog.at_level(logging.WARNING, logger="griffin.io"):
        choice = kernels.choose_kernels(model)
        assert choice.source == "measured" and kernels.choose_kernels(model) is choice  # held for this process
        gen = SpecGenerator(model, NoTokenizer(), untrained_head(model), total_tokens=4)
        monkeypatch.setattr(autotune, "tune", lambda gen, budget_s, temperature: {
            "depth": 2, "top_k": 4, "total_tokens": 3, "reason": "fixed", "tuning_s": 0.0})
        assert autotune.autotune(gen) == (2, 4, 3)
    assert caplog.text.count("holds for this process only; set GRIFFIN_CACHE to a writable folder") == 2
    assert str(tmp_path / "a-file" / "kernels") in caplog.text


# --- device strings this machine cannot run --------------------------------------------------------------------------



@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x", "meta", "cuda", "cuda:7", "mps"])
def test_a_device_this_machine_lacks_is_a_value_error_saying_what_it_has(device, tiny_target_dir, head_dir):
    present = {"cuda": torch.cuda.is_available(), "cuda:7": torch.cuda.device_count() > 7,
               "mps": torch.backends.mps.is_available()}
    if present.get(device):
        pytest.skip("this machine has that device")
    has = "this machine has cpu"
    with pytest.raises(ValueError, match=has):
        target.load_target(tiny_target_dir, device=device)
    with pytest.raises(ValueError, match=has):
        SpecGenerator.from_pretrained(tiny_target_dir, head_dir, device=device, total_tokens=4)
    model, tokenizer = target.load_target(tiny_target_dir)
    with pytest.raises(ValueError, match=has):
        SpecGenerator.from_pretrained(model, head_dir, tokenizer=tokenizer, device=device, total_tokens=4)
    for command in ("inference.demo", "inference.chat"):
        code, err = run_main(command, "--target", str(tiny_target_dir), "--draft", str(head_dir), "--device", device,
                             "--total-tokens", "4")
        assert code == 2 and err.startswith("error: ") and has in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("missing, message", [("model.safetensors", "cannot load the target's weights from"),
                                              ("tokenizer.json", "has no tokenizer that loads")])
def test_a_target_folder_missing_its_weights_or_tokenizer_names_it(missing, message, tiny_target_dir, tmp_path):
    folder = tmp_path / "target"
    shutil.copytree(tiny_target_dir, folder)
    (folder / missing).unlink()
    with pytest.raises(ValueError, match=f"{message} {folder}|{folder} {message}"):
        target.load_target(folder)


# --- silent acceptances: cut JSONL lines, an --out holding another command's output, a store of nothing ------------


def write_jsonl(path, records: list[dict], cut: tuple[int, ...] = ()) -> str:
    """``records`` as JSON Lines, the lines numbered in ``cut`` (1-based) cut in the middle."""
    lines = [json.dumps(r) for r in records]
    path.write_text("".join((line[: len(line) // 2] if i in cut else line) + "\n"
                            for i, line in enumerate(lines, start=1)))
    return str(path)


def test_cut_jsonl_lines_are_named_and_too_many_stop_the_build(tmp_path, tiny_target_dir, caplog):
    data = write_jsonl(tmp_path / "d.jsonl", conversations(6), cut=(2, 5))
    out = ["--target", str(tiny_target_dir), "--data", data, "--max-len", "160"]
    with caplog.at_level(logging.WARNING, logger="training.data"):
        code, err = run_main("training.build_features", *out, "--out", str(tmp_path / "s"))
    assert code == 0, err
    assert f"{data}, line 2: not a JSON record" in caplog.text and f"{data}, line 5: not a JSON record" in caplog.text
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["num_samples"] == 4 and manifest["skipped"] == {"malformed": 2}
    code, err = run_main("training.build_features", *out, "--out", str(tmp_path / "t"), "--max-bad-lines", "1")
    assert code == 2 and f"error: {data}, line 5: 2 lines are not JSON records, more than --max-bad-lines 1" in err
    assert not (tmp_path / "t" / "manifest.json").exists()


def test_an_out_holding_another_commands_output_is_refused_naming_it(tmp_path, tiny_target_dir, head_dir):
    store = tmp_path / "store"
    code, err = run_main("training.build_features", "--target", str(tiny_target_dir), "--max-len", "160", "--data",
                         write_data(tmp_path / "d.json", conversations(3)), "--out", str(store))
    assert code == 0, err
    before = sorted(p.name for p in store.iterdir())
    code, err = run_main("training.train", "--features", str(store), "--out", str(store))
    assert code == 2 and f"--out {store} holds a feature store" in err and "Traceback" not in err
    assert sorted(p.name for p in store.iterdir()) == before
    weights = (tiny_target_dir / "model.safetensors").read_bytes()
    code, err = run_main("training.train", "--features", str(store), "--out", str(tiny_target_dir))
    assert code == 2 and f"--out {tiny_target_dir} holds a llama model (config.json), not a draft head" in err
    assert (tiny_target_dir / "model.safetensors").read_bytes() == weights
    for folder, what in ((head_dir, "a model or draft head (config.json)"),
                         (tiny_target_dir, "a model or draft head (config.json)")):
        before = sorted(p.name for p in folder.iterdir())
        code, err = run_main("training.build_features", "--target", str(tiny_target_dir), "--out", str(folder))
        assert code == 2 and f"--out {folder} holds {what}" in err
        assert sorted(p.name for p in folder.iterdir()) == before


def test_a_build_whose_every_record_was_skipped_leaves_no_complete_looking_store(tmp_path, tiny_target_dir):
    out = tmp_path / "s"
    code, err = run_main("training.build_features", "--target", str(tiny_target_dir), "--out", str(out), "--data",
                         write_data(tmp_path / "d.json", conversations(3)), "--max-len", "8")
    assert code == 2 and "every record was skipped" in err
    assert not (out / "manifest.json").exists()
    code, err = run_main("training.train", "--features", str(out), "--out", str(tmp_path / "head"))
    assert code == 2 and "did not finish" in err, err


def test_a_chat_that_cannot_be_saved_says_so_before_it_starts(tmp_path, tiny_target_dir, head_dir, monkeypatch,
                                                              capsys):
    from inference import chat

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    args = ["--target", str(tiny_target_dir), "--draft", str(head_dir), "--total-tokens", "4", "--max-new-tokens", "4"]
    code, err = run_main("inference.chat", *args, "--save", str(a_file / "chats" / "chat.json"))
    assert code == 2 and f"error: the folder of --save {a_file / 'chats'} is not writable (a parent is a file)" in err
    monkeypatch.setenv("GRIFFIN_CACHE", str(a_file))  # the default place of saved chats cannot be written
    scripted_input(monkeypatch, ["Hello there", ""])
    assert chat.main(args) == 0
    captured = capsys.readouterr()
    assert "[not saving this conversation:" in captured.err and "assistant> " in captured.out
    assert "continue it with" not in captured.out


def test_a_draft_lm_tuning_record_with_a_wrong_gamma_is_named_and_tuned_again(tiny_target_dir, tmp_path, monkeypatch,
                                                                               caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from griffin import draft_lm

    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path / "cache"))
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    draft_lm.save_draft_lm(draft_lm.build_student(model, 1), tmp_path / "student", torch.arange(500),
                           AutoTokenizer.from_pretrained(tiny_target_dir))
    gen = SpecGenerator.from_pretrained(str(tiny_target_dir), draft_model=tmp_path / "student", gamma=3)
    path = tmp_path / "cache" / "autotune" / f"{autotune._tuning_key(gen, 0.0)}.json"
    path.parent.mkdir(parents=True)
    for gamma in (0, -2, 2.5, "4"):
        path.write_text(json.dumps({"gamma": gamma, "temperature": 0.0}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="griffin.io"):
            choice = autotune.tune_gamma(gen, max_gamma=3)
        assert str(path) in caplog.text and f"gamma is {gamma!r}" in caplog.text and "tuning again" in caplog.text
        assert 1 <= choice["gamma"] <= 3 and json.loads(path.read_text())["gamma"] == choice["gamma"]
