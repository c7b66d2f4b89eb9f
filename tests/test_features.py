"""training.build_features: stored features, resumption after a kill, bad input, two processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.conftest import ROOT, run_main, run_module
from training.store import FeatureStore


def conversations(n: int, words: int = 30) -> list[dict]:
    out = []
    for i in range(n):
        q = f"Question {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(words))
        a = f"Answer {i}: " + " ".join(f"v{(i * 3 + j) % 40}" for j in range(words))
        out.append({"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
    return out


def write_data(path, records) -> str:
    path.write_text(json.dumps(records))
    return str(path)


def shards_equal(a, b) -> bool:
    names = sorted(p.name for p in a.glob("shard-*.safetensors"))
    if names != sorted(p.name for p in b.glob("shard-*.safetensors")) or not names:
        return False
    for name in names:
        x, y = load_file(str(a / name)), load_file(str(b / name))
        if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
            return False
    return True


def test_stored_features_equal_direct_forward(tmp_path, tiny_target_dir, smol_tokenizer):
    records = conversations(6, words=12)
    first = write_data(tmp_path / "d.json", records[:3])
    second = tmp_path / "d.jsonl"  # a second source, read after the first (shard 0 spans both files)
    second.write_text("".join(json.dumps(r) + "\n" for r in records[3:]))
    res = run_module("training.build_features", "--target", str(tiny_target_dir), "--data", first, str(second),
                     "--out", str(tmp_path / "store"), "--max-len", "96", "--batch-size", "3", "--shard-size", "4")
    assert res.returncode == 0, res.stderr
    assert "6 conversations" in res.stdout
    store = FeatureStore(tmp_path / "store")
    answers = [smol_tokenizer.decode(store[i].input_ids) for i in range(len(store))]
    assert all(f"Answer {i}:" in text for i, text in enumerate(answers))
    manifest = store.manifest
    for key in ("target", "num_samples", "num_tokens", "hidden_size", "dtype", "max_len"):
        assert key in manifest
    assert manifest["num_samples"] == 6 and manifest["dtype"] == "float16" and manifest["max_len"] == 96
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    for i in range(len(store)):
        item = store[i]
        with torch.no_grad():
            ref = model(item.input_ids[None], output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(item.hidden.float(), ref.half().float(), rtol=0, atol=2e-3)
        assert len(item.input_ids) <= 96 and item.loss_mask.sum() > 0
    assert manifest["num_tokens"] == sum(store.length(i) for i in range(len(store)))


def test_embedded_target_features(tmp_path, embedded):
    data = write_data(tmp_path / "d.json", conversations(2, words=10))
    res = run_module("training.build_features", "--data", data, "--out", str(tmp_path / "s"), "--max-len", "128")
    assert res.returncode == 0, res.stderr
    store = FeatureStore(tmp_path / "s")
    model, _ = embedded
    item = store[1]
    with torch.no_grad():
        ref = model(item.input_ids[None], output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(item.hidden.float(), ref, rtol=2e-3, atol=2e-2)
    assert store.manifest["target"] == "smollm2-135m-instruct" and store.manifest["hidden_size"] == 576


def test_kill_and_resume_gives_the_same_store(tmp_path, tiny_target_dir):
    data = write_data(tmp_path / "d.json", conversations(48, words=150))
    args = ["--target", str(tiny_target_dir), "--data", data, "--max-len", "512", "--shard-size", "2",
            "--batch-size", "1"]
    code, err = run_main("training.build_features", *args, "--out", str(tmp_path / "ref"))
    assert code == 0, err
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "training.build_features", *args, "--out", str(out)], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(out.glob("shard-00002.safetensors")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "the run finished before it could be killed"
    for shard in out.glob("shard-*.safetensors"):  # whatever is visible is complete
        load_file(str(shard))
    with pytest.raises(ValueError, match="did not finish"):
        FeatureStore(out)
    code, err = run_main("training.build_features", *args, "--out", str(out))
    assert code == 0, err
    assert not list(out.glob(".*.tmp"))
    assert shards_equal(tmp_path / "ref", out)
    a, b = json.loads((tmp_path / "ref" / "manifest.json").read_text()), json.loads((out / "manifest.json").read_text())
    assert a == b


def test_rerun_with_other_settings_is_refused(tmp_path, tiny_target_dir):
    data = write_data(tmp_path / "d.json", conversations(3))
    base = ["--target", str(tiny_target_dir), "--data", data, "--out", str(tmp_path / "s")]
    assert run_main("training.build_features", *base, "--max-len", "128")[0] == 0
    code, err = run_main("training.build_features", *base, "--max-len", "100")
    assert code == 2 and "max_len" in err


def test_bad_input_gives_clear_errors_or_counted_skips(tmp_path, tiny_target_dir):
    target = ["--target", str(tiny_target_dir)]
    not_json = tmp_path / "bad.json"
    not_json.write_text("hello")
    code, err = run_main("training.build_features", *target, "--data", str(not_json), "--out", str(tmp_path / "a"))
    assert code == 2 and "not a JSON list" in err

    res = run_module("training.build_features", "--target", "no-such-model", "--out", str(tmp_path / "b"))
    assert res.returncode == 2 and "unknown target 'no-such-model'" in res.stderr and "Traceback" not in res.stderr

    good = conversations(2)
    mixed = good + [
        {"id": "e", "conversations": []},
        {"id": "n", "conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]},
        {"id": "s", "conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"},
                                      {"from": "gpt", "value": "c"}]},  # a continuation record: kept, "a" dropped
        {"id": "m"},
        "not an object",
    ]
    data = write_data(tmp_path / "mixed.json", mixed)
    code, err = run_main("training.build_features", *target, "--data", data, "--out", str(tmp_path / "c"))
    assert code == 0, err
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["num_samples"] == 3
    assert manifest["skipped"] == {"empty": 1, "not_alternating": 1, "malformed": 2}

    code, err = run_main("training.build_features", *target, "--data", data, "--out", str(tmp_path / "d"),
                         "--max-len", "8")
    assert code == 2 and "raise --max-len" in err

    code, err = run_main("training.build_features", *target, "--out", str(tmp_path / "e"), "--max-len", "0")
    assert code == 2 and "argument --max-len: must be an integer >= 1" in err


def test_two_processes_build_the_same_store(tmp_path, tiny_target_dir):
    data = write_data(tmp_path / "d.json", conversations(10))
    args = ["--target", str(tiny_target_dir), "--data", data, "--max-len", "128", "--shard-size", "2"]
    code, err = run_main("training.build_features", *args, "--out", str(tmp_path / "one"))
    assert code == 0, err
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
                "-m"]
    two = run_module("training.build_features", *args, "--out", str(tmp_path / "two"), launcher=launcher)
    assert two.returncode == 0, two.stderr
    assert "process 1 wrote 2 shards" in two.stderr and "process 0 wrote 3 shards" in two.stderr
    assert shards_equal(tmp_path / "one", tmp_path / "two")
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["num_samples"] == 10 and len(manifest["shards"]) == 5


def test_a_linked_view_holds_the_chosen_shards_and_hard_links_outlive_the_source(tmp_path, tiny_target_dir):
    from training.store import link_view, shard_name

    data = write_data(tmp_path / "d.json", conversations(6, words=20))
    code, err = run_main("training.build_features", "--target", str(tiny_target_dir), "--data", data, "--out",
                         str(tmp_path / "src"), "--max-len", "160", "--shard-size", "2")
    assert code == 0, err
    source = FeatureStore(tmp_path / "src")
    view = link_view(tmp_path / "src", [1, 2], tmp_path / "view", "d shards 1..2")
    linked = FeatureStore(view)
    first = source.manifest["shards"][0]["num_samples"]  # conversations of shard 0, which the view leaves out
    assert len(linked) == len(source) - first > 0 and linked.manifest["data"] == "d shards 1..2"
    assert torch.equal(linked[0].input_ids, source[first].input_ids)
    assert not (tmp_path / "view.tmp").exists() and (view / shard_name(0)).is_symlink()
    hard = link_view(tmp_path / "src", [0], tmp_path / "hard", "d shard 0", hard=True)
    expected = source[0].input_ids.clone()
    for shard in (tmp_path / "src").glob("shard-*"):
        shard.unlink()
    assert torch.equal(FeatureStore(hard)[0].input_ids, expected)
