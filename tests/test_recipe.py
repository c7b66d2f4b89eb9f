"""training.recipe and the pieces it streams with: shard ranges of build_features, part ranges of regenerate, and a
run that continues on a fresh machine from the committed heads without rebuilding what they consumed."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_main
from tests.test_features import conversations, shards_equal, write_data
from training import recipe
from training.recipe import cli, progress, publish, schedule, scheduler, steps
from training.recipe import run as loop
from training.store import MANIFEST, StoreError


def test_shard_ranges_build_the_shards_of_a_full_run_and_no_manifest(tmp_path, tiny_target_dir):
    data = write_data(tmp_path / "d.json", conversations(6, words=12))
    args = ["--target", str(tiny_target_dir), "--data", data, "--max-len", "128", "--shard-size", "2"]
    assert run_main("training.build_features", *args, "--out", str(tmp_path / "ref"))[0] == 0
    out = tmp_path / "ranged"
    assert run_main("training.build_features", *args, "--out", str(out), "--shards", "2:3")[0] == 0
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00002.safetensors"]
    assert not (out / "manifest.json").exists()
    assert run_main("training.build_features", *args, "--out", str(out))[0] == 0  # fills in shards 0 and 1
    assert shards_equal(tmp_path / "ref", out)
    code, err = run_main("training.build_features", *args, "--out", str(out), "--shards", "3:1")
    assert code == 2 and "--shards" in err


def test_regenerate_answers_only_the_parts_asked_for(tmp_path, tiny_target_dir, caplog):
    data = write_data(tmp_path / "d.json", conversations(6, words=6))
    out = tmp_path / "regen"
    caplog.set_level(logging.INFO, logger="regenerate")
    code, err = run_main("training.regenerate", "--target", str(tiny_target_dir), "--data", data, "--out", str(out),
                         "--parts", "1:2", "--part-size", "2", "--max-new-tokens", "4")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["part-00001.json", "part-00001.jsonl"]  # no merged file
    lines = [json.loads(x) for x in (out / "part-00001.jsonl").read_text().splitlines()]
    assert [r["id"] for r in lines] == ["2", "3"] and [t["from"] for t in lines[0]["conversations"]] == ["human", "gpt"]
    cost = json.loads((out / "part-00001.json").read_text())  # what the part cost, for the recipe's timings
    assert cost["prompts"] == 2 and 2 <= cost["new_tokens"] <= 8 and cost["seconds"] >= 0
    assert "generation throughput" in caplog.text


def test_regenerate_s_engines_give_each_prompt_its_own_greedy_answer(tmp_path, tiny_target_dir, head_dir):
    """Our batched plain loop and batched speculation (a fixed tree, so that it drafts) answer every row as
    transformers' generate answers its prompt alone (fp32), in batches of 3 (sizes 3, 2, 2 for 7 prompts)."""
    data = write_data(tmp_path / "d.json", conversations(7, words=6))
    runs = {"generate": ["--batch-size", "1"], "plain": ["--batch-size", "3"],
            "speculative": ["--batch-size", "3", "--draft", str(head_dir), "--total-tokens", "4"]}
    answers = {}
    for engine, extra in runs.items():
        out = tmp_path / engine
        code, err = run_main("training.regenerate", "--target", str(tiny_target_dir), "--data", data, "--out",
                             str(out), "--max-new-tokens", "12", "--part-size", "7", "--engine", engine, *extra)
        assert code == 0, err
        lines = [json.loads(x) for x in (out / "conversations.jsonl").read_text().splitlines()]
        answers[engine] = {r["id"]: r["conversations"][-1]["value"] for r in lines}
    assert len(answers["generate"]) == 7 and len(set(answers["generate"].values())) > 1
    assert answers["plain"] == answers["generate"] and answers["speculative"] == answers["generate"]


def test_regenerate_s_plain_loop_refuses_a_sliding_window_it_would_cross(tmp_path, smol_tokenizer):
    from tests.conftest import tiny_model

    target = tmp_path / "mistral"
    tiny_model("mistral", vocab_size=len(smol_tokenizer), hidden=32, sliding_window=8).save_pretrained(target)
    smol_tokenizer.save_pretrained(target)
    data = write_data(tmp_path / "d.json", conversations(2, words=6))
    code, err = run_main("training.regenerate", "--target", str(target), "--data", data, "--out",
                         str(tmp_path / "out"), "--max-new-tokens", "4", "--engine", "plain")
    assert code == 2 and "sliding-window" in err and "--engine generate" in err


def test_even_batches_keep_the_order_and_differ_in_size_by_one_at_most():
    from training.regenerate import even_batches

    assert even_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(b) for b in even_batches(list(range(190)), 16)] == [16] * 10 + [15] * 2
    assert even_batches(list(range(4)), 16) == [[0, 1, 2, 3]] and even_batches([], 16) == []


@pytest.fixture(autouse=True)
def not_stopping():
    """A test whose run stops (``stop_steps``) leaves STOPPING set until the next ``run``: the scheduler's own tests
    must not find it set."""
    yield
    scheduler.STOPPING.clear()


def tiny_recipe(tmp_path, target_dir, *argv: str) -> tuple:
    """-> (--checkpoints, the recipe's arguments) for 8 short conversations in shards of 4 and a tiny target."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(8, words=10)))
    ckpt = tmp_path / "ckpt"
    return ckpt, ["--target", str(target_dir), "--data", str(data), "--checkpoints", str(ckpt), "--ship", str(tmp_path),
                  "--record", str(tmp_path / "record" / "recipe.json"), "--shard-records", "4",
                  "--regen-new-tokens", "4", "--max-len", "128", "--draft-vocab", "512", "--batch-size", "2", *argv]


@pytest.mark.parametrize("jobs", [1, 3])
def test_recipe_continues_on_a_fresh_machine_from_the_committed_heads(tmp_path, tiny_target_dir, monkeypatch,
                                                                      caplog, jobs):
    calls = []
    training = {"now": 0, "most": 0}  # training steps asked for at once

    beside = threading.Event()  # chunk 2's features are asked for (in a second process)
    one_at_a_time = threading.Lock()  # in one process, steps must not overlap: loading a model sets torch's default
    # dtype, which is process-wide, so a model loaded beside another could get some tensors in the other's dtype

    def in_process(module: str, *argv: str, again=None) -> float:  # the recipe's steps, without a process each
        calls.append((module, argv))
        if module == "training.build_features" and "1:2" in argv:
            beside.set()
        if module == "training.regenerate" and "0:1" in argv and jobs > 1:  # chunk 1, the fresh machine's first
            assert beside.wait(30), "chunk 2's data was not built beside chunk 1's"
        if module == "training.train":
            training["now"] += 1
            training["most"] = max(training["most"], training["now"])
        try:
            with one_at_a_time:
                t0 = time.time()
                assert importlib.import_module(module).main(list(argv)) == 0
                return time.time() - t0
        finally:
            training["now"] -= module == "training.train"

    monkeypatch.setattr(scheduler, "python", in_process)
    ckpt, args = tiny_recipe(tmp_path, tiny_target_dir, "--chunk-shards", "1", "--stage-chunks", "3,1,0.01",
                             "--regen-records", "2")
    machine = {"--work": str(tmp_path / "work"), "--sharegpt-store": str(tmp_path / "sharegpt")}
    argv = args + [x for kv in machine.items() for x in kv]
    assert recipe.main(argv + ["--chunks", "1"]) == 0
    code, err = run_main("training.recipe", *argv, "--promote")
    assert code == 2 and "chunks: griffin 1, griffin-k1 1," in err and "run the recipe to the end first" in err
    state = json.loads((ckpt / "recipe.json").read_text())
    # chunks: ShareGPT group 0, answers to group 0, ShareGPT group 1, answers to group 1
    assert state["settings"]["chunks"] == 4 and state["settings"]["stage_ends"] == [3, 4, 4]
    assert {k: v["chunks"] for k, v in state["heads"].items()} == {"griffin-s1": [0], "eagle-s1": [0]}
    assert not (tmp_path / "work" / "regen").exists()  # chunk 0 is ShareGPT's
    head = load_file(str(ckpt / "wip-griffin-s1" / "model.safetensors"))
    assert all(t.dtype == torch.float16 for t in head.values() if t.is_floating_point())
    # the fixed validation set: chunk 0's held-out conversation, as its record, committed beside the heads
    held_out = [json.loads(x) for x in (ckpt / "fixed-val-sharegpt.jsonl").read_text().splitlines()]
    assert len(held_out) == 1 and held_out[0] in conversations(8, words=10)[:4]
    assert not (ckpt / "fixed-val-regen.jsonl").exists()  # taken when the recipe reaches chunk 1
    assert all(p["fixed"]["sharegpt"][0]["top1"] is not None for p in state["curve"])
    # a curve from before the fixed set: its points are scored where their runs are still on the machine
    scored = [point.pop("fixed") for point in state["curve"]]
    (ckpt / "recipe.json").write_text(json.dumps(state))
    (tmp_path / "work" / "runs" / "griffin-s1" / "chunk-000" / "fixed-val-sharegpt.json").unlink()
    before = len(calls)
    assert recipe.main(argv + ["--chunks", "1"]) == 0
    backfilled = json.loads((ckpt / "recipe.json").read_text())["curve"]
    assert [p.get("fixed") for p in backfilled] == scored  # griffin-s1 scored again, eagle-s1 from its report
    run = tmp_path / "work" / "runs" / "griffin-s1" / "chunk-000"
    assert [(m, a[0]) for m, a in calls[before:]] == [("training.evaluate", str(run))]  # only the lost report

    for folder in machine.values():  # a fresh machine: only the committed folder is left
        shutil.rmtree(folder)
    calls.clear()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the recipe sets them for its steps: restored after the test
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    with caplog.at_level(logging.INFO, logger="recipe"):
        assert recipe.main(argv + ["--jobs", str(jobs), "--threads", "2"]) == 0
    ahead = [r.getMessage() for r in caplog.records if "data ahead" in r.getMessage()]
    if jobs > 1:  # chunk 0 was trained before: chunks 2 and 3 are built ahead, heads train side by side
        assert ahead == [f"building chunk {c}'s data ahead, while chunk 1 is built and trained on" for c in (2, 3)]
        assert training["most"] > 1
    else:
        assert not ahead and training["most"] == 1
    state = json.loads((ckpt / "recipe.json").read_text())
    stage1 = [0, 1, 2]
    assert {k: v["chunks"] for k, v in state["heads"].items()} == {
        "griffin-s1": stage1, "eagle-s1": stage1, "griffin": stage1 + [3], "griffin-k1": stage1 + [3],
        "eagle-tat": stage1 + [3], "hass": stage1 + [3], "eagle2": stage1 + [3]}
    built = [a for m, a in calls if m == "training.build_features" and "--shards" in a]
    assert [a[a.index("--shards") + 1] for a in built] == ["1:2"]  # chunk 0 is never rebuilt
    assert not list((tmp_path / "sharegpt").glob("shard-*"))  # chunk 2's shard went once every head trained on it
    regen = [a[a.index("--parts") + 1] for m, a in calls if m == "training.regenerate"]
    assert regen == ["0:1", "1:2"]
    first = json.loads((tmp_path / "work" / "runs" / "griffin-s1" / "chunk-001" / "validation.json").read_text())
    assert first["run"]["init_from"] == str(ckpt / "wip-griffin-s1")  # the committed head after chunk 0
    # chunk 1 holds the target's answers: its peak rate is REGEN_LR of the schedule's
    assert first["run"]["lr"] == pytest.approx(schedule.LR[1] * schedule.LR_DECAY * schedule.REGEN_LR, rel=1e-2)
    assert [p["lr"] for p in state["curve"] if p["head"] == "griffin-s1"] == pytest.approx(
        [schedule.LR[1] * schedule.LR_DECAY ** i * (schedule.REGEN_LR if i == 1 else 1) for i in range(3)], rel=1e-2)
    run = json.loads((tmp_path / "work" / "runs" / "griffin" / "chunk-003" / "validation.json").read_text())["run"]
    assert run["init_from"] == str(tmp_path / "work" / "runs" / "griffin-s1" / "chunk-002")
    assert run["steps"] == 2 and run["topk"] == 3
    hass = json.loads((tmp_path / "work" / "runs" / "hass" / "chunk-003" / "validation.json").read_text())["run"]
    assert hass["arch"] == "eagle" and hass["topk"] == 0 and hass["steps"] == 2
    stages = json.loads((ckpt / "wip-griffin" / "stages.json").read_text())
    assert [s["run"]["steps"] for s in stages] == [1, 1, 1, 2]
    assert "GRIFFIN" in (ckpt / "wip-griffin" / "README.md").read_text()
    assert "Learning curve" in (ckpt / "README.md").read_text()
    assert [r["head"] for r in state["curve"]] == ["griffin-s1", "eagle-s1"] * 3 + [h.name for h in schedule.HEADS]
    assert [t["kind"] for t in state["timings"]] == ["sharegpt", "regen", "sharegpt", "regen"]
    assert all("features_s" in t for t in state["timings"][1:]) and "regenerate_s" in state["timings"][3]
    assert [sorted(t["train_s"]) for t in state["timings"]] == [["eagle-s1", "griffin-s1"]] * 3 + [
        sorted(h.name for h in schedule.HEADS)]
    # each step's threads: chunk 0's run had one, this run two, and the card says so where there were more
    assert [set(t["train_threads"].values()) for t in state["timings"]] == [{1}, {2}, {2}, {2}]
    assert [sorted(t["train_threads"]) for t in state["timings"]] == [sorted(t["train_s"]) for t in state["timings"]]
    assert [t["data_threads"] for t in state["timings"]] == [1, 2, 2, 2]
    labelled = [len(t["train_s"]) + ("features_s" in t) for t in state["timings"][1:]]
    card = (ckpt / "README.md").read_text()
    answered = sum("regenerate_s" in t for t in state["timings"][1:])  # their cells name the engine too
    assert card.count(" (2 threads)") == sum(labelled) and card.count(" (2 threads, plain)") == answered >= 1
    assert f"| {state['timings'][2]['features_s']} (2 threads) |" in card  # chunk 2's features, built by this run
    # on the fresh machine the fixed set's features came from the committed records, and every point was scored
    assert [a[a.index("--data") + 1] for m, a in calls if m == "training.build_features" and "--shards" not in a
            and "fixed-val" in a[a.index("--out") + 1]] == [str(ckpt / f"fixed-val-{k}.jsonl") for k in
                                                             ("sharegpt", "regen")]
    answers = [json.loads(x) for x in (ckpt / "fixed-val-regen.jsonl").read_text().splitlines()]
    assert len(answers) == 1 and [t["from"] for t in answers[0]["conversations"]] == ["human", "gpt"]
    # chunk 0's runs were lost with the machine before the regen set existed: only they lack it
    assert [sorted(p["fixed"]) for p in state["curve"]] == [["sharegpt"]] * 2 + [["regen", "sharegpt"]] * 9
    assert all(len(passes) == p["steps"] for p in state["curve"] for passes in p["fixed"].values())
    assert "fixed regen: top-1 per pass" in (ckpt / "README.md").read_text()
    dtype = steps.resolve_precision("auto")  # every step computes in the one precision of the run
    assert {a[a.index("--dtype") + 1] for m, a in calls if "--dtype" in a} == {dtype}
    assert {a[a.index("--mixed-precision") + 1] for m, a in calls if "--mixed-precision" in a} == {
        "bf16" if dtype == "bf16" else "no"}
    assert {t["precision"] for t in state["timings"][1:]} == {dtype}

    calls.clear()
    assert recipe.main(argv) == 0 and calls == []  # all done: nothing runs
    assert (ckpt / "README.md").read_text().startswith("# The recipe's heads (complete")
    cfg = json.loads((ckpt / progress.STATE).read_text())["settings"]
    behind = copy.deepcopy(state)
    behind["heads"]["hass"]["chunks"].pop()
    assert progress.progress_markdown(cfg, behind).startswith("# Heads in training (work in progress)")
    assert recipe.main(argv + ["--promote"]) == 0  # shipped beside the work folder, named as the ablation reads them
    assert [m for m, _ in calls] == ["training.export"] * len(schedule.HEADS)
    for head in schedule.HEADS:
        shipped = ckpt.parent / f"{tiny_target_dir.name}-{head.name}"
        assert (shipped / "model.safetensors").read_bytes() == (ckpt / f"wip-{head.name}" / "model.safetensors"
                                                                ).read_bytes()
        card = (shipped / "README.md").read_text()
        assert card.startswith(f"# {head.label} draft head") and "on all 4 chunks" in card
    record = tmp_path / "record"  # the run's record is published with the heads
    assert json.loads((record / "recipe.json").read_text()) == json.loads((ckpt / progress.STATE).read_text())
    assert (record / "progress.md").read_text() == (ckpt / "README.md").read_text()
    assert (record / "fixed-val-regen.jsonl").read_text() == (ckpt / "fixed-val-regen.jsonl").read_text()

    fresh = [x if x != str(ckpt) else str(tmp_path / "fresh") for x in argv]  # a clone: no work folder of heads
    calls.clear()
    assert recipe.main(fresh) == 0 and calls == []  # it continues from the record and the shipped heads: all done
    for head in schedule.HEADS:
        assert (tmp_path / "fresh" / f"wip-{head.name}" / "model.safetensors").read_bytes() == (
            tmp_path / f"{tiny_target_dir.name}-{head.name}" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "fresh" / progress.STATE).read_text())["heads"] == state["heads"]
    shutil.rmtree(tmp_path / "fresh")
    behind = json.loads((record / "recipe.json").read_text())
    behind["heads"]["hass"]["chunks"].pop()  # a record of other heads than the shipped ones
    (record / "recipe.json").write_text(json.dumps(behind))
    code, err = run_main("training.recipe", *fresh)
    assert code == 2 and "has hass after 3 chunks, but" in err and "is not that head" in err
    code, err = run_main("training.recipe", *argv, "--chunk-shards", "2")
    assert code == 2 and "other settings" in err


def test_committed_answers_spare_a_fresh_machine_their_regeneration_and_go_once_every_head_trained(
        tmp_path, tiny_target_dir, monkeypatch):
    calls = []

    def in_process(module: str, *argv: str, again=None) -> float:
        calls.append(module)
        assert importlib.import_module(module).main(list(argv)) == 0
        return 1.0

    monkeypatch.setattr(scheduler, "python", in_process)
    ckpt, args = tiny_recipe(tmp_path, tiny_target_dir, "--chunk-shards", "2", "--stage-chunks", "1,0.01,0.01",
                             "--work", str(tmp_path / "work"), "--sharegpt-store", str(tmp_path / "sharegpt"))
    # one group of 8 records, all stage 1: chunk 0 its ShareGPT, chunk 1 the answers to its first 4 (3 rounded up)
    assert recipe.main(args + ["--regen-records", "3", "--heads", "griffin-s1"]) == 0
    state = json.loads((ckpt / "recipe.json").read_text())
    assert state["settings"]["regen_records"] == 4 and state["heads"]["griffin-s1"]["chunks"] == [0, 1]
    answers = ckpt / steps.ANSWERS / "chunk-001.jsonl"
    assert len(answers.read_text().splitlines()) == 4  # kept: eagle-s1 has yet to train on chunk 1
    assert [t.get("regen_records") for t in state["timings"]] == [None, 4]
    assert "| 1 | regen | 1 | 4 |" in (ckpt / "README.md").read_text()  # its conversations: the 4 answers

    costs = [json.loads(c.read_text())["seconds"] for c in sorted((tmp_path / "work" / "regen").glob("*.json"))]
    assert len(costs) == 1 and state["timings"][1]["regenerate_s"] == round(sum(costs))  # its parts' own seconds
    shutil.rmtree(tmp_path / "work")  # a fresh machine, and a run that answers more first turns per group
    shutil.rmtree(tmp_path / "sharegpt")
    calls.clear()
    assert recipe.main(args + ["--regen-records", "8", "--heads", "eagle-s1"]) == 0
    assert "training.regenerate" not in calls  # the committed answers were used
    state = json.loads((ckpt / "recipe.json").read_text())
    assert state["heads"]["eagle-s1"]["chunks"] == [0, 1] and state["settings"]["regen_records"] == 8
    assert state["timings"][1]["regen_records"] == 4  # chunk 1 ends as it began
    # each build took 1 s: the rebuilds here replace the lost machine's seconds (its answers were not redone)
    assert [(t["features_s"], t.get("regenerate_s")) for t in state["timings"]] == [(1, None), (1, round(sum(costs)))]
    assert not answers.exists()  # every head of the stage has trained on chunk 1
    code, err = run_main("training.recipe", *args, "--regen-records", "0")
    assert code == 2 and "with regenerated answers" in err and "--regen-records above 0" in err


def test_a_recipe_commit_amends_its_own_previous_one_on_a_work_branch_never_on_main(tmp_path, monkeypatch):
    import subprocess
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], check=True, capture_output=True, text=True).stdout

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CONFIG_COUNT", "2")  # an identity for the commits, whatever this machine's config
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "user.name")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "t")
    monkeypatch.setenv("GIT_CONFIG_KEY_1", "user.email")
    monkeypatch.setenv("GIT_CONFIG_VALUE_1", "t@t")
    git("init", "-q", "-b", "main")
    (tmp_path / "README.md").write_text("x")
    git("add", "README.md")
    git("commit", "-q", "-m", "a landed commit")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    args = Namespace(checkpoints=str(ckpt))

    def chunk(i: int) -> None:  # a head after chunk i, and the answers of the chunk after it
        (ckpt / "head.safetensors").write_text(str(i))
        (ckpt / f"answers-{i}.jsonl").write_text(str(i))
        if (ckpt / f"answers-{i - 1}.jsonl").exists():
            (ckpt / f"answers-{i - 1}.jsonl").unlink()
        publish.commit(args, f"head after chunk {i}")

    for i in range(2):  # on main, whose commits land as they are, every commit is new
        chunk(i)
    assert len(git("log", "--format=%s").splitlines()) == 3
    git("checkout", "-q", "-b", "scale")
    for i in range(2, 5):  # the first commit of the work branch is new (main holds HEAD), the others amend it
        chunk(i)
    assert git("log", "--format=%s").splitlines() == ["recipe: head after chunk 4", "recipe: head after chunk 1",
                                                      "recipe: head after chunk 0", "a landed commit"]
    assert sorted(git("diff", "--name-only", "main", "HEAD").split()) == ["ckpt/answers-1.jsonl",
                                                                          "ckpt/answers-4.jsonl",
                                                                          "ckpt/head.safetensors"]
    git("branch", "kept")  # another ref holds the run's commit: the next one is new
    chunk(5)
    assert len(git("log", "--format=%s").splitlines()) == 5
    t0 = time.time()
    publish.commit(args, "nothing new")  # nothing changed: no commit, and no retries
    assert len(git("log", "--format=%s").splitlines()) == 5 and time.time() - t0 < 5


def test_a_chunk_built_ahead_records_its_precision_and_a_chunk_not_built_shows_none():
    """A data build that ran ahead records the run's precision and threads with its seconds, and the card shows no
    precision for a chunk nothing has been built for yet (only rows from before --precision, which have seconds, read
    bf16)."""
    from concurrent.futures import Future

    cfg = {"generation": 3, "regen_records": 1, "chunk_shards": 1, "shards": 4, "stage_ends": [4, 4, 4], "chunks": 4,
           "records": 8}
    state = {"heads": {}, "curve": [], "timings": [{"chunk": 0, "kind": "sharegpt", "stage": 1, "train_s": {},
                                                     "features_s": 10}]}  # a row from before --precision
    done, pending = Future(), Future()
    done.set_result(None)
    loop.collect_ahead(Namespace(dtype="fp32", threads=2), state, cfg,
                       {1: (done, {"features_s": 7}), 2: (pending, {"features_s": 3})})
    progress.chunk_timing(state, cfg, 3)  # reached, nothing built
    rows = {t["chunk"]: t for t in state["timings"]}
    assert rows[1]["precision"] == "fp32" and rows[1]["features_s"] == 7 and 2 not in rows
    assert rows[1]["data_threads"] == 2  # the run's threads too
    table = progress.progress_markdown(cfg, state)
    assert "| 0 | sharegpt | 1 | - | - | bf16 | - | 10 |" in table  # a row from before threads were recorded: one
    assert "| 1 | regen | 1 | - | - | fp32 | - | 7 (2 threads) |" in table
    rows[1].update(regenerate_s=40, regen_engines=["generate", "plain"])
    table = progress.progress_markdown(cfg, state)
    assert "| 1 | regen | 1 | - | - | fp32 | 40 (2 threads, generate, plain) | 7 (2 threads) |" in table
    assert "| 3 | regen | 1 | - | - | - | - | - |" in table


def test_a_build_ahead_replaces_a_lost_machines_seconds_and_adds_to_a_resumed_steps(monkeypatch):
    """A data build that ran ahead updates its chunk's row as a build of the present chunk does (``add_seconds``): a
    step that started afresh (its work was lost with another machine) replaces the row's seconds, a step resumed on
    this machine adds to them; a build that found its data done leaves the row, and the run's precision, alone."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(scheduler, "FREE", free(slots=2, submitted=0))
    monkeypatch.setattr(steps, "chunk_records", lambda state, cfg, chunk: 0)
    fresh = {1: True, 2: False, 3: None}  # None: the store exists, nothing to build

    def build(args, cfg, chunk, costs, records):
        if fresh[chunk] is not None:
            progress.add_seconds(costs, "features_s", 500, fresh[chunk])

    monkeypatch.setattr(steps, "build_chunk", build)
    cfg = {"regen_records": 0, "chunk_shards": 1, "shards": 4, "stage_ends": [4, 4, 4]}
    rows = [{"chunk": c, "kind": "sharegpt", "stage": 1, "train_s": {}, "precision": "fp32", "features_s": 3159}
            for c in (1, 2, 3)]
    state = {"timings": rows}
    ahead = {}
    with ThreadPoolExecutor(3) as pool:
        for chunk in (1, 2, 3):
            loop.submit_build(None, cfg, state, pool, ahead, chunk, present=0)
        for future, _ in ahead.values():
            future.result(30)
    loop.collect_ahead(Namespace(dtype="bf16", threads=2), state, cfg, ahead)
    assert [r["features_s"] for r in rows] == [500, 3659, 3159]
    assert [r["precision"] for r in rows] == ["bf16", "bf16", "fp32"]
    loop.collect_ahead(Namespace(dtype="bf16", threads=2), state, cfg, ahead)  # collected once only
    assert [r["features_s"] for r in rows] == [500, 3659, 3159]


def test_finished_regeneration_parts_are_committed_and_spare_a_fresh_machine_their_answers(tmp_path, monkeypatch):
    ckpt, work = tmp_path / "ckpt", tmp_path / "work"
    args = Namespace(checkpoints=str(ckpt), work=str(work), dtype="fp32", regen_batch=2, regen_engine="plain")
    cfg = {"generation": 2, "chunk_shards": 2, "shards": 4, "chunks": 4, "stage_ends": [4, 4, 4], "shard_records": 4,
           "target": "t", "data": "d", "regen_new_tokens": 4,
           "regen_records": 8}  # chunk 1: group 0 (parts 0-1), 3: group 1
    state = {"heads": {"griffin-s1": {"chunks": [0, 1]}, "eagle-s1": {"chunks": [0]}}}
    (work / "regen").mkdir(parents=True)
    for part in (0, 2):  # a part of chunk 1, which eagle-s1 has yet to train on, and a part of chunk 3
        (work / "regen" / f"part-{part:05d}.jsonl").write_text(f"answers {part}\n")
    (work / "regen" / "part-00002.json").write_text('{"seconds": 500.4}\n')  # what part 2 cost this machine
    steps.keep_parts(args, cfg | {"regen_records": 0}, state)  # a run without answers chunks keeps no parts
    assert not (ckpt / steps.ANSWERS).exists()
    steps.keep_parts(args, cfg, state)
    assert sorted(p.name for p in (ckpt / steps.ANSWERS).iterdir()) == ["part-00000.jsonl", "part-00002.json",
                                                                         "part-00002.jsonl"]
    shutil.rmtree(work)  # a fresh machine
    asked = []

    def regenerate(module: str, *argv: str) -> float:  # answers the parts still missing
        out, parts = Path(argv[argv.index("--out") + 1]), argv[argv.index("--parts") + 1]
        asked.append(sorted(p.name for p in out.glob("part-*.jsonl")))
        for part in range(*map(int, parts.split(":"))):
            if not (out / f"part-{part:05d}.jsonl").is_file():
                engine = argv[argv.index("--engine") + 1]
                (out / f"part-{part:05d}.json").write_text(json.dumps({"seconds": 300.3, "engine": engine}) + "\n")
                (out / f"part-{part:05d}.jsonl").write_text(f"answers {part}\n")
        return 1.0

    monkeypatch.setattr(scheduler, "python", regenerate)
    timing = {}
    merged = steps.regenerated(args, cfg, 3, range(2, 4), 8, timing)
    assert asked == [["part-00002.jsonl"]]  # the committed part was there before the regeneration began
    assert merged.read_text() == "answers 2\nanswers 3\n" == steps.answers_file(args, 3).read_text()
    # both parts' own seconds, not the 1 s of the run that ended the chunk; part 2's cost predates engines: generate
    assert timing == {"regenerate_s": 801, "regen_engines": ["generate", "plain"]}
    # a run that stopped after the answers, before their seconds were saved: the next one finds them in the parts
    assert steps.regenerated(args, cfg, 3, range(2, 4), 8) == merged and len(asked) == 1
    assert steps.answered_cost(args, cfg, range(2, 4), 8)["regenerate_s"] == 801
    assert not steps.answers_part(args, 2).exists()  # the merged answers stand for it
    assert not (ckpt / steps.ANSWERS / "part-00002.json").exists()
    steps.keep_parts(args, cfg, state)  # chunk 3's answers are committed merged: its parts are not kept again
    assert sorted(p.name for p in (ckpt / steps.ANSWERS).iterdir()) == ["chunk-003.jsonl", "part-00000.jsonl"]
    state["heads"]["eagle-s1"]["chunks"] = [0, 1]  # every head has trained on chunk 1: its parts are not kept
    steps.answers_part(args, 0).unlink()
    (work / "regen" / "part-00000.jsonl").write_text("answers 0\n")
    steps.keep_parts(args, cfg, state)
    assert not steps.answers_part(args, 0).exists()


def test_a_stopped_run_commits_what_it_had_finished(tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(4, words=10)))
    ckpt, work = tmp_path / "ckpt", tmp_path / "work"
    (work / "regen").mkdir(parents=True)
    (work / "regen" / "part-00000.jsonl").write_text("answers\n")  # a finished part of chunk 1
    commits = []
    monkeypatch.setattr(publish, "commit", lambda args, message: commits.append(message))

    def stopped(*arguments):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "run_chunk", stopped)
    code, err = run_main("training.recipe", "--data", str(data), "--checkpoints", str(ckpt), "--work", str(work),
                         "--shard-records", "2", "--commit")
    assert code == 130 and "interrupted" in err
    assert commits == ["what a stopped run had finished"]
    assert steps.answers_part(Namespace(checkpoints=str(ckpt)), 0).read_text() == "answers\n"


def free(**counts) -> dict:
    """The recipe's process bookkeeping (scheduler.FREE) of --jobs 2 with nothing waiting, but for ``counts``."""
    return {"slots": 2, "ahead": 1, "waiting": 0, "short": 0, "turns": [], "queued": [], "jobs": 2, "alone": 0} | counts


def test_a_step_of_a_chunk_built_ahead_waits_while_a_step_of_the_present_chunk_waits(monkeypatch):
    monkeypatch.setattr(scheduler, "FREE", free(slots=1, waiting=1))  # a present step waits
    ran = threading.Event()

    def step_built_ahead() -> None:
        scheduler.AHEAD.chunk = 1
        with scheduler.slot():
            ran.set()

    thread = threading.Thread(target=step_built_ahead)
    thread.start()
    assert not ran.wait(0.5)  # the free process is the present's
    with scheduler.SLOTS:
        scheduler.FREE["waiting"] = 0  # the present's step took another one
        scheduler.SLOTS.notify_all()
    assert ran.wait(30)
    thread.join(30)
    assert scheduler.FREE == free(slots=1)
    scheduler.AHEAD.chunk = None
    with scheduler.slot():  # a step of the present takes a free process at once
        assert scheduler.FREE == free(slots=0)


def test_a_trained_heads_scoring_goes_before_the_next_heads_training(monkeypatch):
    """Both processes train: when one ends, the head it trained is scored (then exported and committed) before another
    head starts a training that would hold the process for an hour."""
    monkeypatch.setattr(scheduler, "FREE", free(slots=0))
    order = []

    def step(module: str) -> None:
        with scheduler.slot(short=module in scheduler.SHORT_STEPS):
            order.append(module)

    threads = []
    for module in ("training.train", "training.evaluate"):  # the training asks first
        threads.append(threading.Thread(target=step, args=(module,)))
        threads[-1].start()
        deadline = time.time() + 30
        while scheduler.FREE["waiting"] < len(threads) and time.time() < deadline:
            time.sleep(0.01)
    with scheduler.SLOTS:
        scheduler.FREE["slots"] = 1  # a training ends
        assert scheduler.FREE["short"] == 1 and scheduler.may_take(None, short=True) and not scheduler.may_take(None)
        scheduler.SLOTS.notify_all()
    for thread in threads:
        thread.join(30)
    assert order == ["training.evaluate", "training.train"]
    assert scheduler.FREE == free(slots=1)


def test_the_present_chunks_trainings_start_in_the_order_they_were_submitted(monkeypatch):
    """Longest first (``longest_first``), whichever thread asks first: the chunk ends with a short training."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(scheduler, "FREE", free(slots=0, submitted=-1))
    order, asked = [], []

    def training(name: str) -> None:
        asked.append(name)
        if name == "griffin":
            time.sleep(0.3)  # the first turn asks for a process last
        scheduler.python("training.train", name)

    monkeypatch.setattr(scheduler, "run_step", lambda module, name: order.append(name))
    with ThreadPoolExecutor(3) as pool:
        futures = scheduler.present_steps(pool, 0, {name: (training, name) for name in ("griffin", "hass", "eagle2")})
        deadline = time.time() + 30
        while len(asked) < 3 and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        with scheduler.SLOTS:
            scheduler.FREE["slots"] = 1  # one process for all three, one after another
            scheduler.SLOTS.notify_all()
        for future in futures.values():
            future.result(30)
    assert order == ["griffin", "hass", "eagle2"] and scheduler.FREE == free(slots=1, submitted=0)


def test_a_step_killed_for_memory_runs_again_alone_once_the_other_steps_end(tmp_path, monkeypatch):
    """The kernel's out-of-memory killer ends a step by SIGKILL while another step holds the other process: the killed
    step waits until that one ends, then runs again with every process, and nothing else starts meanwhile."""
    (tmp_path / "killed_once.py").write_text(
        "import os, signal, sys\n"
        "runs = open(sys.argv[1], 'a+')\n"
        "runs.seek(0)\n"
        "first = not runs.read()\n"
        "runs.write('run\\n')\n"
        "runs.close()\n"
        "if first:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(scheduler, "FREE", free())
    runs = tmp_path / "runs.txt"
    held, release, result = threading.Event(), threading.Event(), {}

    def other_step() -> None:  # holds one process until released
        with scheduler.slot():
            held.set()
            release.wait(60)

    def killed_step() -> None:
        result["seconds"] = scheduler.python("killed_once", str(runs))

    holder = threading.Thread(target=other_step)
    holder.start()
    assert held.wait(30)
    thread = threading.Thread(target=killed_step)
    thread.start()
    deadline = time.time() + 60
    while scheduler.FREE["alone"] == 0 and time.time() < deadline:  # killed, now waiting to run alone
        time.sleep(0.01)
    assert scheduler.FREE["alone"] == 1 and runs.read_text() == "run\n"
    with scheduler.SLOTS:
        assert scheduler.FREE["slots"] == 1 and not scheduler.may_take(None)  # the free process stays free
    time.sleep(0.3)
    assert runs.read_text() == "run\n"  # not again while the other step runs
    release.set()
    holder.join(30)
    thread.join(60)
    assert runs.read_text() == "run\nrun\n" and result["seconds"] >= 0
    assert scheduler.FREE == free()


def test_a_step_killed_twice_fails_the_recipe(tmp_path, monkeypatch):
    (tmp_path / "always_killed.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(scheduler, "FREE", free())
    with pytest.raises(scheduler.StepKilled, match="always_killed was killed"):
        scheduler.python("always_killed")
    assert scheduler.FREE == free()


def test_a_training_killed_for_memory_runs_again_resuming_the_checkpoint_it_left(tmp_path, monkeypatch):
    """The first run of a chunk's training has no checkpoint to resume; once killed after its first save, the run
    alone continues that checkpoint (without --resume, train refuses an --out that holds one)."""
    monkeypatch.setattr(scheduler, "FREE", free())
    args = Namespace(work=str(tmp_path / "work"), checkpoints=str(tmp_path / "heads"), dtype="bf16")
    cfg = {"stage_ends": [2, 4], "regen_records": 0, "chunk_shards": 1, "shards": 4, "batch_size": 4,
           "draft_vocab": 64}
    runs: list[tuple[str, ...]] = []

    def run_step(module: str, *argv: str) -> float:
        runs.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        if len(runs) == 1:
            (out / "train_state").mkdir(parents=True)  # the killed run's save at its update 50
            raise scheduler.StepKilled("python -m training.train was killed (SIGKILL; out of memory?)")
        return 1.0

    monkeypatch.setattr(scheduler, "run_step", run_step)
    run = steps.train(args, cfg, {"heads": {}}, schedule.GEN3[0], 0, tmp_path / "store")
    assert run == Path(args.work) / "runs" / "eagle3" / "chunk-000"
    assert "--resume" not in runs[0] and runs[1] == (*runs[0], "--resume")
    assert scheduler.FREE == free()


def test_longest_first_orders_heads_by_their_last_training_on_a_chunk_of_the_same_kind():
    heads = {h.name: h for h in schedule.HEADS}
    cfg = {"regen_records": 1, "chunk_shards": 1, "shards": 4}  # even chunks ShareGPT, odd ones the target's answers
    state = {"timings": [
        {"chunk": 2, "kind": "sharegpt", "train_s": {"griffin": 900, "hass": 1400, "eagle2": 400, "griffin-k1": 500}},
        {"chunk": 3, "kind": "regen", "train_s": {"griffin": 350, "hass": 340, "eagle2": 120, "griffin-k1": 160}},
        {"chunk": 4, "kind": "sharegpt", "train_s": {"griffin": 1000, "eagle2": 410}},
    ]}
    todo = [heads[name] for name in ("griffin", "griffin-k1", "eagle-tat", "hass", "eagle2")]
    names = [h.name for h in steps.longest_first(state, cfg, 6, todo)]
    assert names == ["eagle-tat", "hass", "griffin", "griffin-k1", "eagle2"]  # eagle-tat: no time yet
    assert [h.name for h in steps.longest_first(state, cfg, 5, todo)][1:] == ["griffin", "hass", "griffin-k1",
                                                                              "eagle2"]


def test_builds_ahead_never_hold_the_last_process(monkeypatch):
    """The present chunk's steps come one after another (an export, then the next head): between two of them no step
    of the present waits, and builds ahead must not take every process in that moment."""
    monkeypatch.setattr(scheduler, "FREE", free(slots=2))  # --jobs 2
    started = [threading.Event(), threading.Event()]
    done = threading.Event()

    def step_built_ahead(i: int) -> None:
        scheduler.AHEAD.chunk = i + 1
        with scheduler.slot():
            started[i].set()
            done.wait(30)

    def present_step() -> None:
        with scheduler.slot():
            present.set()

    builds = [threading.Thread(target=step_built_ahead, args=(i,)) for i in range(2)]
    for thread in builds:
        thread.start()
    assert started[0].wait(30) or started[1].wait(30)
    time.sleep(0.3)
    assert sum(e.is_set() for e in started) == 1  # the second build waits: one process stays the present's
    present = threading.Event()
    threading.Thread(target=present_step).start()
    assert present.wait(30)  # at once, beside the running build
    done.set()
    for thread in builds:
        thread.join(30)
    assert all(e.is_set() for e in started) and scheduler.FREE == free(slots=2)


def test_the_nearest_chunk_built_ahead_takes_a_free_process_first(monkeypatch):
    monkeypatch.setattr(scheduler, "FREE", free(slots=0))  # its process is busy
    order = []

    def step_built_ahead(chunk: int) -> None:
        scheduler.AHEAD.chunk = chunk
        with scheduler.slot():
            order.append(chunk)

    scheduler.FREE.update(slots=1, queued=[26, 25])  # a process is free, and steps of chunks 26 and 25 wait for it
    assert scheduler.may_take(25) and not scheduler.may_take(26)
    scheduler.FREE.update(slots=0, queued=[])
    threads = []
    for chunk in (26, 25):  # the later chunk asks first
        threads.append(threading.Thread(target=step_built_ahead, args=(chunk,)))
        threads[-1].start()
        deadline = time.time() + 30
        while chunk not in scheduler.FREE["queued"] and time.time() < deadline:
            time.sleep(0.01)
    with scheduler.SLOTS:
        scheduler.FREE["slots"] = 1  # the process comes free
        scheduler.SLOTS.notify_all()
    for thread in threads:
        thread.join(30)
    assert order == [25, 26] and scheduler.FREE == free(slots=1)


def test_a_chunk_built_ahead_after_the_present_ones_kind_starts_once_the_present_training_is_asked_for(monkeypatch):
    """Else it would take the process that the present chunk's data frees before the present's heads ask for it."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(scheduler, "FREE", free(slots=2, submitted=-1))
    built = []
    monkeypatch.setattr(steps, "build_chunk", lambda args, cfg, chunk, seconds, records: built.append(chunk))
    monkeypatch.setattr(steps, "chunk_records", lambda state, cfg, chunk: 0)
    cfg = {"regen_records": 1, "chunk_shards": 1, "shards": 2,  # chunks 0, 2: ShareGPT; 1, 3: the target's answers
           "stage_ends": [4, 4, 4]}
    ahead = {}
    with ThreadPoolExecutor(4) as pool:
        for chunk in range(4):  # chunk 0 is the present one, 1 to 3 are built ahead
            loop.submit_build(None, cfg, {"timings": []}, pool, ahead, chunk, present=0)
        for chunk in (0, 1, 3):
            ahead[chunk][0].result(30)
        time.sleep(0.3)
        # chunk 3 followed chunk 1, which is not the present one; chunk 2 waits for chunk 0's heads to ask for processes
        assert sorted(built) == [0, 1, 3]
        ran = scheduler.present_steps(pool, 0, {"griffin": (lambda: "trained",)})
        ahead[2][0].result(30)
        assert sorted(built) == [0, 1, 2, 3] and ran["griffin"].result(30) == "trained"
    # a step that started no process is not waiting
    assert scheduler.FREE == free(slots=2, submitted=0)


def test_a_failing_chunk_ends_the_steps_beside_it_and_starts_no_more(tmp_path, monkeypatch):
    started = tmp_path / "started"

    def step_then_another() -> None:  # a long step, then one that must not start once the recipe stops
        try:
            scheduler.python("timeit", "-n", "1", "import time; time.sleep(120)")
        except RuntimeError:
            pass
        scheduler.python("timeit", "-n", "1", f"open({str(started)!r}, 'w')")

    def failing_chunk(args, cfg, state, path, chunk, stop, pool, ahead, last_commit):
        pool.submit(step_then_another)
        ahead[chunk + 1] = (pool.submit(scheduler.python, "timeit", "-n", "1", "import time; time.sleep(120)"), {})
        pool.submit(scheduler.python, "timeit", "-n", "1", f"open({str(started)!r}, 'w')")  # queued behind both
        deadline = time.time() + 30
        while len(scheduler.RUNNING) < 2 and time.time() < deadline:
            time.sleep(0.05)
        raise RuntimeError("python -m training.train failed with exit code 1")

    monkeypatch.setattr(loop, "run_chunk", failing_chunk)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(4, words=10)))
    t0 = time.time()
    code, err = run_main("training.recipe", "--data", str(data), "--checkpoints", str(tmp_path / "ckpt"), "--work",
                         str(tmp_path / "work"), "--shard-records", "2", "--jobs", "2")
    assert code == 2 and "training.train failed" in err
    assert time.time() - t0 < 60 and not scheduler.RUNNING  # the steps were ended, not waited for
    assert not started.exists()  # neither the queued step nor the one after the ended step ran


def test_kill_stops_the_steps_and_a_second_recipe_on_the_same_work_is_refused(tmp_path, monkeypatch):
    """SIGTERM (``kill PID``, or a recipe in a background job that ignores Ctrl-C) ends the steps' processes with the
    recipe, so that none runs on holding its folder's lock; two recipes never share a --work folder."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(4, words=10)))
    argv = ["--data", str(data), "--checkpoints", str(tmp_path / "ckpt"), "--work", str(tmp_path / "work"),
            "--shard-records", "2", "--jobs", "2"]
    second = {}

    def killed_chunk(args, cfg, state, path, chunk, stop, pool, ahead, last_commit):
        pool.submit(scheduler.python, "timeit", "-n", "1", "import time; time.sleep(120)")
        deadline = time.time() + 30
        while not scheduler.RUNNING and time.time() < deadline:
            time.sleep(0.05)
        second["run"] = run_main("training.recipe", *argv)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the signal interrupts this
        raise AssertionError("SIGTERM did not stop the recipe")

    def unhandled(signum, frame):
        raise AssertionError("the recipe left SIGTERM to the default action (the process would die, its steps run on)")

    monkeypatch.setattr(loop, "run_chunk", killed_chunk)
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        t0 = time.time()
        code, err = run_main("training.recipe", *argv)
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == 130 and "interrupted" in err
    assert time.time() - t0 < 30 and not scheduler.RUNNING  # the step's process was ended, not waited for
    code, err = second["run"]
    assert code == 2 and "another recipe is running with --work" in err


@pytest.mark.parametrize("cuda, avx512_bf16, amx, expected", [(False, False, False, "fp32"),
                                                               (False, True, False, "bf16"),
                                                               (False, False, True, "bf16"),
                                                               (True, False, False, "bf16")])
def test_auto_precision_is_bf16_only_where_the_hardware_computes_it(monkeypatch, cuda, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert steps.resolve_precision("auto") == expected
    assert [steps.resolve_precision(p) for p in ("bf16", "fp32")] == ["bf16", "fp32"]


def test_the_eagle3_generation_trains_its_heads_with_training_time_test_on_three_layer_features(
        tmp_path, tiny_target_dir, monkeypatch):
    calls = []

    def in_process(module: str, *argv: str, again=None) -> float:
        calls.append((module, argv))
        assert importlib.import_module(module).main(list(argv)) == 0
        return 0.0

    monkeypatch.setattr(scheduler, "python", in_process)
    eagle3, griffin3 = schedule.GEN3
    assert [schedule.training_topk(griffin3, c) for c in (0, 9, 10, 30)] == [3, 3, 0, 0]  # the mask to chunk 9 only
    assert [schedule.training_topk(eagle3, c) for c in (0, 10)] == [0, 0]
    monkeypatch.setattr(schedule, "GEN3", [eagle3, dataclasses.replace(griffin3, mask_until=1)])  # here: at chunk 1
    ckpt, args = tiny_recipe(tmp_path, tiny_target_dir, "--chunk-shards", "1", "--regen-records", "2",
                             "--generation", "3", "--work", str(tmp_path / "work"),
                             "--sharegpt-store", str(tmp_path / "sharegpt"))
    assert recipe.main(args + ["--chunks", "2"]) == 0
    state = json.loads((ckpt / "recipe.json").read_text())
    assert state["settings"]["generation"] == 3
    assert {k: v["chunks"] for k, v in state["heads"].items()} == {"eagle3": [0, 1], "griffin3": [0, 1]}
    features = [a for m, a in calls if m == "training.build_features"]
    assert features and all(a[a.index("--feature-layers") + 1] == "auto" for a in features)
    runs = {h: json.loads((tmp_path / "work" / "runs" / h / "chunk-001" / "validation.json").read_text())["run"]
            for h in ("eagle3", "griffin3")}
    assert (runs["eagle3"]["arch"], runs["eagle3"]["ttt_steps"], runs["eagle3"]["topk"]) == ("eagle3", 7, 0)
    assert (runs["griffin3"]["arch"], runs["griffin3"]["ttt_steps"], runs["griffin3"]["topk"]) == ("griffin3", 7, 0)
    first = tmp_path / "work" / "runs" / "griffin3" / "chunk-000" / "validation.json"
    assert json.loads(first.read_text())["run"]["topk"] == 3  # the chunks before mask_until keep the mask
    scored = [a for m, a in calls if m == "training.evaluate" and "griffin3" in a[0]]
    assert len(scored) == 4 and all(a[a.index("--topk") + 1] == "3" for a in scored)  # one way for the whole curve
    assert runs["eagle3"]["init_from"] == str(tmp_path / "work" / "runs" / "eagle3" / "chunk-000")
    config = json.loads((ckpt / "wip-griffin3" / "config.json").read_text())
    assert config["arch"] == "griffin3" and len(config["feature_layers"]) == 3
    assert [len(p["fixed"]["sharegpt"]) for p in state["curve"]] == [3] * 4  # scored over 3 passes
    # once both heads trained on a chunk its features go (three layers: 3.2 GB per chunk here); the fixed sets stay
    work = tmp_path / "work"
    assert not list((tmp_path / "sharegpt").glob("shard-*")) and not (work / "chunks" / "chunk-000").exists()
    assert not (work / "regen-features" / "chunk-001").exists()
    assert all((work / f"fixed-val-{kind}" / MANIFEST).is_file() for kind in ("sharegpt", "regen"))
    assert recipe.main(args + ["--chunks", "3", "--keep-features"]) == 0
    assert [p.name for p in (tmp_path / "sharegpt").glob("shard-*")] == ["shard-00001.safetensors"]
    assert (work / "chunks" / "chunk-002" / MANIFEST).is_file()
    # a rerun with a larger --draft-vocab widens each head before its next chunk; a smaller one is refused
    calls.clear()
    assert recipe.main(args + ["--chunks", "4", "--draft-vocab", "640"]) == 0
    widen = [a for m, a in calls if m == "training.vocab"]
    assert [(a[0], a[a.index("--size") + 1]) for a in widen] == [
        (str(work / "runs" / h / "chunk-002"), "640") for h in ("eagle3", "griffin3")]
    trained = {a[a.index("--arch") + 1]: a for m, a in calls if m == "training.train"}
    assert trained["eagle3"][trained["eagle3"].index("--init-from") + 1] == str(work / "runs" / "eagle3" /
                                                                                 "chunk-003-init-640")
    assert all(a[a.index("--draft-vocab") + 1] == "640" for a in trained.values())
    assert json.loads((ckpt / "recipe.json").read_text())["settings"]["draft_vocab"] == 640
    assert json.loads((ckpt / "wip-eagle3" / "config.json").read_text())["draft_vocab_size"] == 640
    settings = json.loads((ckpt / "recipe.json").read_text())["settings"] | {"draft_vocab": None}
    progress.load_state(ckpt / "recipe.json", settings)  # no --draft-vocab: the record's; a new recipe: 8192
    assert settings["draft_vocab"] == 640 and cli.parse_args([]).draft_vocab is None
    other = settings | {"draft_vocab": None, "max_len": 64}  # a record not used lends its vocabulary to nothing
    with pytest.raises(StoreError, match="max_len differ"):
        progress.load_state(ckpt / "recipe.json", other)
    assert other["draft_vocab"] is None
    fresh = settings | {"draft_vocab": None}
    assert progress.load_state(tmp_path / "none.json", fresh)["settings"]["draft_vocab"] == schedule.DRAFT_VOCAB == 8192
    code, err = run_main("training.recipe", *args, "--chunks", "5")  # its --draft-vocab 512 would cut the heads'
    assert code == 2 and "would not widen" in err and len(err.strip().splitlines()) == 1
    # the second generation's names are refused here, and its defaults are its own
    code, err = run_main("training.recipe", "--generation", "3", "--heads", "griffin")
    assert code == 2 and "--heads must name some of eagle3, griffin3" in err
    assert cli.parse_args(["--generation", "3"]).checkpoints == "checkpoints/smollm2-135m-instruct-recipe3"


def test_the_next_chunk_is_built_ahead_only_for_a_head_that_will_train_on_it():
    cfg = {"generation": 2, "stage_ends": [2, 3, 4]}  # chunks 0-1 stage 1, chunk 2 stage 2, chunk 3 stage 3
    state = {"heads": {"griffin-s1": {"chunks": [0]}, "eagle-s1": {"chunks": [0]}}}
    eagle_s1 = next(h for h in schedule.STAGE1 if h.name == "eagle-s1")
    # griffin-s1 lags (it is not among the heads of this run): chunk 2 would wait for it, so nothing is built ahead
    assert loop.next_chunk(Namespace(heads=["eagle-s1", "griffin"]), cfg, state, 1, [eagle_s1], 4) is None
    # eagle-s1 training on chunk 1 makes its forks (HASS, EAGLE-2, w/o TAD) due on chunk 2
    assert loop.next_chunk(Namespace(heads=[]), cfg, state, 1, [eagle_s1], 4) == 2
    assert loop.next_chunk(Namespace(heads=[]), cfg, state, 3, [], 4) is None  # the last chunk of the run
    assert loop.chunks_ahead(Namespace(heads=[], ahead=2), cfg, state, 1, [eagle_s1], 4) == [2, 3]
    ahead = cli.parse_args(["--ahead", "0"]).ahead  # every process to the present chunk's heads
    assert loop.chunks_ahead(Namespace(heads=[], ahead=ahead), cfg, state, 1, [eagle_s1], 4) == []
    code, err = run_main("training.recipe", "--ahead", "-1")
    assert code == 2 and "--ahead and --regen-records at least 0" in err


def test_commit_refuses_a_folder_git_ignores(tmp_path):
    """The default export folder lives under the git-ignored work/: --commit names the mend instead of failing
    to commit it at every chunk."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(2, words=5)))
    code, err = run_main("training.recipe", "--data", str(data), "--work", str(tmp_path / "work"), "--commit")
    assert code == 2 and "git ignores work/recipe/heads: give --checkpoints a tracked folder" in err
