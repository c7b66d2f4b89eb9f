"""Tree auto-tuning and the speed-run command."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import pytest
import torch

from griffin import DraftConfig, DraftModel, SpecGenerator, autotune
from griffin.autotune import cut_tree_yield
from griffin.tree import build_tree
from tests.conftest import ROOT, fake_result, run_module, tiny_model


def chain_tree(length: int):
    """A root, a chain of `length` nodes with falling scores, and a depth-1 sibling ranked second."""
    # candidates in level order: chain node 1, the sibling, chain nodes 2..length
    tokens = torch.arange(length + 1)
    scores = torch.tensor([-0.1, -0.15] + [-0.1 * (i + 1) for i in range(1, length)])
    parents = torch.tensor([-1, -1, 0] + list(range(2, length)))
    levels = torch.tensor([1, 1] + list(range(2, length + 1)))
    return build_tree(torch.tensor([99]), tokens, scores, parents, levels, total_tokens=length + 1)


def test_cut_tree_yield_counts_the_path_inside_smaller_trees():
    tree = chain_tree(4)  # node ids: 1 (depth 1), 2 (sibling, depth 1), 3, 4, 5
    assert tree.depths.tolist() == [0, 1, 1, 2, 3, 4]
    path = torch.tensor([0, 1, 3, 4])  # the target accepted three chain nodes
    trace = [(tree, path)]
    assert cut_tree_yield(trace, total=5, depth=8) == (4, 6)  # 3 accepted + the bonus token; all 6 nodes verified
    assert cut_tree_yield(trace, total=5, depth=2) == (3, 4)  # depth 2 cuts after two nodes
    assert cut_tree_yield(trace, total=2, depth=8) == (2, 3)  # the 2 best nodes: chain node 1 and the sibling
    assert cut_tree_yield(trace, total=3, depth=8) == (3, 4)


class CharTokenizer:
    """Characters as token ids, with a chat template that keeps the last message."""

    eos_token_id = None
    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return messages[-1]["content"]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 64 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(48 + int(i)) for i in ids)


def test_auto_tree_size_is_measured_within_seconds_explained_and_cached(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "BUDGET_S", 4.0)
    caplog.set_level(logging.INFO, logger="griffin.autotune")
    target = tiny_model("llama", vocab_size=64)
    torch.manual_seed(0)
    head = DraftModel(DraftConfig.from_target(target.config))
    t0 = time.perf_counter()
    gen = SpecGenerator.from_pretrained(target, head, tokenizer=CharTokenizer(), total_tokens="auto")
    assert time.perf_counter() - t0 < 8.0  # the budget, plus the check's least turns (noise needs three)
    files = list((tmp_path / "autotune").glob("*.json"))
    assert len(files) == 1
    choice = json.loads(files[0].read_text())
    assert (gen.depth, gen.total_tokens) == (choice["depth"], choice["total_tokens"])
    assert 1 <= gen.depth <= autotune.MAX_DEPTH and 0 <= gen.total_tokens <= autotune.MAX_TOTAL  # 0: no tree
    assert choice["calibration_cycles"] >= autotune.MIN_CYCLES and choice["forward_cost_s"]["1"] > 0
    costs = [choice["forward_cost_s"][str(n)] for n in sorted(map(int, choice["forward_cost_s"]))]
    assert costs == sorted(costs)  # made non-decreasing
    assert all(row["tau"] <= choice["calibration_tau"] + 1e-9 for row in choice["candidates"])
    summary = [r.message for r in caplog.records if r.message.startswith("draft tree:")]
    assert len(summary) == 1 and f"{autotune.describe(choice)}, chosen in" in summary[0]
    assert "default tree" in summary[0]  # the reason names how the choice compared with the default tree
    caplog.clear()
    again = SpecGenerator.from_pretrained(target, head, tokenizer=CharTokenizer(), total_tokens="auto")
    assert (again.depth, again.total_tokens) == (gen.depth, gen.total_tokens)
    assert "tuned for this machine on" in caplog.text and "chosen in" not in caplog.text
    SpecGenerator.from_pretrained(target, head, tokenizer=CharTokenizer(), total_tokens="auto", retune=True)
    assert "chosen in" in caplog.text


def test_tuning_on_a_machine_too_busy_to_measure_keeps_the_default_tree_within_the_budget(monkeypatch, tmp_path):
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    target = tiny_model("llama", vocab_size=64)
    gen = SpecGenerator(target, CharTokenizer(), DraftModel(DraftConfig.from_target(target.config)))

    def slowed(fn):
        def slow(*args, **kwargs):
            time.sleep(0.1)  # every target pass takes 100 ms: a busy machine
            return fn(*args, **kwargs)
        return slow

    for name in ("prefill", "forward"):  # the passes of generation and of the cost curve
        monkeypatch.setattr(gen.backend, name, slowed(getattr(gen.backend, name)))
    t0 = time.perf_counter()
    choice = autotune.tune(gen, budget_s=1.0)
    assert time.perf_counter() - t0 < 1.5
    assert (choice["depth"], choice["total_tokens"]) == autotune.DEFAULT_TREE
    assert choice["reason"].startswith("the default tree: only") and choice["calibration_cycles"] < autotune.MIN_CYCLES
    assert choice["unsettled"] == "too few calibration cycles"  # tuned again at the next loads


def test_speed_run_writes_results(tmp_path, embedded):
    model, _ = embedded
    torch.manual_seed(0)
    DraftModel(DraftConfig.from_target(model.config, draft_vocab_size=4096)).save_pretrained(tmp_path / "head")
    res = run_module("inference.speed", "--bench", "gsm8k", "--draft", str(tmp_path / "head"), "--limit", "1",
                     "--max-new-tokens", "8", "--out-dir", str(tmp_path / "results"))
    assert res.returncode == 0, res.stderr
    result = json.loads((tmp_path / "results" / "gsm8k-head-T0.json").read_text())
    for key in ("bench", "target", "draft", "temperature", "max_new_tokens", "n_prompts", "tau", "speedup",
                "speedup_vs_own_loop", "tokens_per_s", "baseline_tokens_per_s", "identical_fraction", "peers",
                "machine", "command", "speedup_vs_fastest_plain", "own_loop_identical_fraction"):
        assert key in result, key
    assert result["kernels"]["one_row"] == result["own_loop_one_row"] and result["kernels"]["source"] in (
        "measured", "cached")  # the embedded target is large enough to be timed
    plain = max(result["baseline_tokens_per_s"], result["own_loop_tokens_per_s"])
    assert result["speedup_vs_fastest_plain"] == pytest.approx(result["tokens_per_s"] / plain)
    assert result["fastest_plain"] in ("baseline", "own_loop")
    assert result["identical_fraction"] == 1.0 and result["n_prompts"] == 1
    from griffin.io import weights_digest

    assert result["draft_digest"] == weights_digest(tmp_path / "head")  # which weights were measured
    tuning = result["tuning"]  # why the tree is what it is: the tuner's record for the run's temperature band
    assert tuning["temperature"] == 0.0 and tuning["reason"] and tuning["expected_tau"] >= 1
    assert f"Tree chosen by the tuner on this machine: {tuning['reason']}." in (
        tmp_path / "results" / "gsm8k-head-T0.md").read_text()
    assert result["command"].startswith("python -m inference.speed --bench gsm8k --draft")
    assert (tmp_path / "results" / "gsm8k-head-T0.md").read_text().startswith("# gsm8k")
    answer = json.loads((tmp_path / "results" / "answers" / "gsm8k-head-T0.jsonl").read_text())
    assert answer["question_id"] == 0 and len(answer["choices"][0]["turns"]) == 1
    assert not list((tmp_path / "results").glob(".*partial*"))


def test_speed_per_turn_reports_tau_and_the_speedup_over_the_fastest_plain_decoding():
    from inference.speed import table, turn_summary

    def record(turn: int, ours_s: float, cycles: int) -> dict:  # 12 new tokens for every method
        return {"turn": turn, "ours": {"seconds": ours_s, "tokens": list(range(12)), "stats": {"cycles": cycles}},
                "baseline": {"seconds": 2.0, "tokens": list(range(12))},
                "own_loop": {"seconds": 1.5, "tokens": list(range(12))}}

    first = turn_summary([record(0, 1.0, 6), record(0, 1.0, 6)], ["baseline", "ours", "own_loop"])
    assert first == {"n_prompts": 2, "tau": 2.0, "tokens_per_s": 12.0, "speedup_vs_fastest_plain": 1.5,
                     "speedup": 2.0}
    second = turn_summary([record(1, 0.5, 3)], ["ours", "baseline"])  # no own loop: generate is the fastest plain
    assert second["tau"] == 4.0 and second["speedup_vs_fastest_plain"] == second["speedup"] == 4.0
    text = table({"bench": "mt_bench", "draft": "h", "temperature": 0.0, "n_questions": 2, "n_prompts": 3,
                  "max_new_tokens": 12, "target": "t", "dtype": "fp32", "tree": {}, "tau": 2.4, "tokens_per_s": 14.4,
                  "by_turn": {"1": first, "2": second}, "command": "c",
                  "machine": {"cpu": "x", "cores": 2, "torch": "2", "date": "d"}})
    assert "| turn 1 (2 prompts): τ, speedup vs | τ 2.00; 1.50x the fastest plain decoding, 2.00x generate |" in text
    assert "| turn 2 (1 prompts): τ, speedup vs | τ 4.00; 4.00x the fastest plain decoding, 4.00x generate |" in text


def test_resume_keeps_only_questions_with_every_turn(tmp_path):
    from inference.speed import load_partial

    settings = {"bench": "mt_bench", "seed": 0}
    questions = [{"question_id": 81, "turns": ["a", "b"]}, {"question_id": 82, "turns": ["c", "d"]}]
    done = [{"question_id": 81, "turn": 0}, {"question_id": 81, "turn": 1}]
    path = tmp_path / ".run.partial.jsonl"
    # question 82: its first turn was written, its second cut by a kill
    path.write_text("".join(json.dumps(x) + "\n" for x in [settings, *done, {"question_id": 82, "turn": 0}])
                    + '{"question_id": 82, "tu')
    assert load_partial(path, settings, questions) == done
    assert [json.loads(line) for line in path.read_text().splitlines()] == [settings, *done]
    # a complete last record whose newline was not written: the next append must not join it
    path.write_text("".join(json.dumps(x) + "\n" for x in [settings, *done]).rstrip("\n"))
    assert load_partial(path, settings, questions) == done and path.read_text().endswith("\n")
    assert load_partial(path, {**settings, "seed": 1}, questions) == []
    path.write_text('{"bench": "mt_')  # a header cut by a kill
    assert load_partial(path, settings, questions) == []


def test_export_writes_fp16_weights_and_a_card(tmp_path, tiny_target_dir):
    from training import export

    src = tmp_path / "head"
    head = DraftModel(DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  vocab_size=50, target={"name": "tiny"}))
    head.save_pretrained(src)
    passes = [{"pass": 1, "loss": 1.0, "top1": 0.5, "top3": 0.7, "kept": 1.0, "positions": 10}]
    run = {"arch": "griffin", "steps": 1, "topk": 3, "lr": 1e-3, "total_updates": 5, "global_batch": 4,
           "mixed_precision": "bf16", "features": "f", "train_conversations": 9, "val_conversations": 1,
           "noise": 0.2, "init_from": None}
    (src / "validation.json").write_text(json.dumps({"run": run, "epochs": [
        {"epoch": 0, "updates": 5, "tokens": 100, "train_seconds": 36.0, "passes": passes}]}))
    results = tmp_path / "results"
    results.mkdir()
    dst = tmp_path / "tiny-griffin"
    assert export.main([str(src), str(dst), "--name", "GRIFFIN", "--results", str(results)]) == 0
    from griffin.io import weights_digest

    (results / "mt_bench-tiny-griffin-T0.json").write_text(json.dumps(fake_result("mt_bench", "x", 0.0, 3.1,
                                                                                  weights_digest(dst))))
    (results / "gsm8k-tiny-griffin-T0.json").write_text(json.dumps(fake_result("gsm8k", "x", 0.0, 9.0, "earlier")))
    tagged = fake_result("humaneval", "tiny-griffin-lookup10", 0.0, 4.2, weights_digest(dst))  # `--tag lookup10`
    tagged["tree"]["lookup"] = 10
    (results / "humaneval-tiny-griffin-lookup10-T0.json").write_text(json.dumps(tagged))
    other = fake_result("humaneval", "tiny-griffin-k1", 0.0, 7.7, "another head")  # a folder name with this prefix
    (results / "humaneval-tiny-griffin-k1-T0.json").write_text(json.dumps(other))
    per_prompt = [{"question_id": q, "turn": 0, "ours": {"new_tokens": n}, "cycles": 10} for q, n in ((1, 20), (2, 30))]
    replay = {"bench": "extra_tasks", "tree": {"depth": 5, "top_k": 8, "total_tokens": 24}, "draft_dtype": "float32",
              "machine": {"date": "2026-11-30 07:00 UTC"}, "command": "python -m inference.tau --bench extra_tasks",
              "head_digests": {"tiny-griffin": weights_digest(dst), "eagle": "another head"},
              "heads": {"tiny-griffin": {"0": {"per_prompt": per_prompt}}, "eagle": {"0": {"per_prompt": []}}}}
    (results / "tau-extra_tasks-T0.json").write_text(json.dumps(replay))
    for name, date, prompts in (("later", "2026-12-01", 2), ("earlier", "2026-11-29", 1)):  # the same replay again,
        # in a later study and on fewer prompts: the first on the most prompts gives the row
        again = {**replay, "machine": {"date": f"{date} 07:00 UTC"}, "heads": {"tiny-griffin": {"0": {
            "per_prompt": per_prompt[:prompts]}}}}
        (results / f"tau-extra_tasks-T0-{name}.json").write_text(json.dumps(again))
    assert export.main([str(src), str(dst), "--name", "GRIFFIN", "--results", str(results)]) == 0  # refresh the card
    assert DraftModel.from_pretrained(dst).config == head.config
    from safetensors import safe_open

    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fusion.fc.weight").dtype == torch.float16
    card = (dst / "README.md").read_text()
    assert card.startswith("# GRIFFIN draft head for tiny") and "| 1 | 0.50 | 0.70 | 1.00 | 1.00 |" in card
    assert "3.10" in card and "python -m inference.speed mt_bench" in card
    assert "| humaneval | 0.00 | fp32 | 80 | 128 | 24 nodes, depth 5 + lookup 10 | 4.20 |" in card  # a tagged run
    assert "9.00" not in card and "gsm8k" not in card  # a run of an earlier head exported to the same folder
    assert "7.70" not in card  # nor another head's
    assert "| extra_tasks | 0.00 | 2 | 24 nodes, depth 5 | float32 | 2.50 ± 0.50 | 2026-11-30 07:00 UTC |" in card
    assert "| extra_tasks | 0.00 | 1 |" not in card and "python -m inference.tau --bench extra_tasks" in card


@pytest.mark.parametrize("lookup", ["0", "4"])
def test_demo_with_no_tree_is_plain_decoding_or_prompt_lookup_alone(tiny_target_dir, head_dir, capsys, lookup):
    from inference import demo

    assert demo.main(["--target", str(tiny_target_dir), "--draft", str(head_dir), "--total-tokens", "0", "--lookup",
                      lookup, "--max-new-tokens", "12", "--prompt", "Say something."]) == 0
    out = capsys.readouterr().out
    assert "output identical to transformers' generate" in out and "tree of 0 nodes" in out
    if lookup == "0":
        assert "tau 1.09 tokens/pass" in out  # 12 tokens, the first from the prompt's pass, then one per pass


def test_demo_runs_what_the_tuner_measured_best_with_or_without_a_chain_and_says_why(tiny_target_dir, head_dir,
                                                                                     capsys, tmp_path, monkeypatch):
    from inference import demo

    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "BUDGET_S", 2.0)
    gains = iter([1.0, 1.3])  # without the chain, then with it: the chain measured faster against the plain loop
    monkeypatch.setattr(demo, "measured_gain", lambda record: next(gains))
    assert demo.main(["--target", str(tiny_target_dir), "--draft", str(head_dir), "--max-new-tokens", "6",
                      "--prompt", "Say something."]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("configuration (tuned on this machine): ") and "Why: " in lines[0]
    assert "lookup 10" in lines[0] or "the plain loop" in lines[0]
    assert len(list((tmp_path / "autotune").glob("*.json"))) == 2  # tuned with and without the chain


def test_the_shipped_head_is_the_default_and_accepts_drafts(embedded):
    model, tokenizer = embedded
    gen = SpecGenerator.from_pretrained(model, tokenizer=tokenizer, depth=5, top_k=8, total_tokens=16)
    assert gen.draft_path is not None and gen.draft_path.name == "smollm2-135m-instruct-griffin"
    assert gen.draft.config.arch == "griffin" and gen.draft.config.target["name"] == "smollm2-135m-instruct"
    new = cycles = 0
    for prompt in ("Write a short poem about the sea.", "What is a hash table?"):
        ids = gen.encode([{"role": "user", "content": prompt}])
        result = gen.generate(ids, max_new_tokens=32)
        assert torch.equal(result.sequences, model.generate(ids[None], max_new_tokens=32, do_sample=False))
        new, cycles = new + result.stats.new_tokens - 1, cycles + result.stats.cycles
    assert new / cycles > 1.5  # a trained head: drafts are accepted (an untrained one gives about 1.0)


def test_the_tree_follows_the_temperature_band_each_band_tuned_once_by_sampling(tmp_path, monkeypatch):
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "BUDGET_S", 3.0)
    target = tiny_model("llama", vocab_size=64)
    torch.manual_seed(0)
    head = DraftModel(DraftConfig.from_target(target.config))

    def records() -> dict:
        return {json.loads(p.read_text())["temperature"]: p for p in (tmp_path / "autotune").glob("*.json")}

    gen = SpecGenerator.from_pretrained(target, head, tokenizer=CharTokenizer(), total_tokens="auto")
    assert set(records()) == {0.0}
    calibrations = []
    loop = autotune.decode

    def watched(backend, drafter, ids, max_new_tokens, sampling, eos, generator, *args, **kwargs):
        calibrations.append((sampling.temperature, generator is not None))
        return loop(backend, drafter, ids, max_new_tokens, sampling, eos, generator, *args, **kwargs)

    monkeypatch.setattr(autotune, "decode", watched)  # the tuner's own runs of the decode loop
    gen.generate("abc", max_new_tokens=4, temperature=1.0, seed=0)
    assert set(records()) == {0.0, 1.0}
    assert len(calibrations) > 2 and set(calibrations) == {(1.0, True)}  # tuned by sampling at T=1, seeded
    sampled = json.loads(records()[1.0].read_text())
    assert (gen.depth, gen.total_tokens) == (sampled["depth"], sampled["total_tokens"])
    for band, tree in ((0.0, (1, 1)), (1.0, (2, 5))):  # make the two records differ, to see which one is used
        record = json.loads(records()[band].read_text()) | {"depth": tree[0], "total_tokens": tree[1]}
        records()[band].write_text(json.dumps(record))
    again = SpecGenerator.from_pretrained(target, head, tokenizer=CharTokenizer(), total_tokens="auto")
    assert (again.depth, again.total_tokens) == (1, 1)
    again.generate("abc", max_new_tokens=4, temperature=0.96, seed=0)  # band 1.0: read, not tuned
    assert (again.depth, again.total_tokens) == (2, 5) and len(records()) == 2
    again.generate("abc", max_new_tokens=4)
    assert (again.depth, again.total_tokens) == (1, 1)
    again.total_tokens = 3  # set by hand: holds while the band does not change
    again.generate("abc", max_new_tokens=4)
    assert again.total_tokens == 3
    again.generate("abc", max_new_tokens=4, temperature=0.3, seed=0)
    assert set(records()) == {0.0, 0.3, 1.0}
    assert autotune.temperature_band(0.01) == 0.1 and autotune.temperature_band(0) == 0.0
    autotune.tune(again, budget_s=1.0, temperature=0.5)  # called directly: its generations start no nested tuning
    assert set(records()) == {0.0, 0.3, 1.0}
    fixed = SpecGenerator.from_pretrained(target, head, tokenizer=CharTokenizer(), total_tokens=4)
    fixed.generate("abc", max_new_tokens=4, temperature=0.7, seed=0)
    assert fixed.total_tokens == 4 and len(records()) == 3


def test_the_tuner_keeps_the_plain_loop_unless_a_tree_beats_it_beyond_the_noise(tmp_path, monkeypatch):
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    target = tiny_model("llama", vocab_size=64)
    torch.manual_seed(0)
    gen = SpecGenerator(target, CharTokenizer(), DraftModel(DraftConfig.from_target(target.config)))
    timed = []
    seconds: dict = {}  # per tree: seconds per token in each turn (the turn is the seed)

    def seconds_per_token(gen, ids, tree, max_new_tokens, temperature, seed):
        timed.append(tree)
        per_turn = seconds.get(tree, seconds["tree"])
        return per_turn[seed % len(per_turn)]

    monkeypatch.setattr(autotune, "_seconds_per_token", seconds_per_token)
    monkeypatch.setattr(autotune, "MIN_TURNS", autotune.CHECK_TURNS)  # every turn below, however busy the machine
    seconds.update({autotune.NO_TREE: [1.0], "tree": [2.0]})  # every tree is slower
    choice = autotune.tune(gen, budget_s=3.0)
    assert (choice["depth"], choice["total_tokens"]) == autotune.NO_TREE and autotune.NO_TREE in timed
    assert choice["reason"].startswith("the plain loop: no tree beat it")
    assert "the default tree 0.50x" in choice["reason"] and "unsettled" not in choice  # no tree pays: settled
    seconds["tree"] = [0.99]  # 1 % faster: within MIN_GAIN
    choice = autotune.tune(gen, budget_s=3.0)
    assert choice["total_tokens"] == 0 and "unsettled" not in choice
    seconds["tree"] = [1 / 1.5, 1 / 0.8, 1 / 1.4, 1 / 0.9, 1 / 1.3, 1.0]  # a median of 1.15x, but far from steady
    noisy = autotune.tune(gen, budget_s=3.0)
    assert noisy["total_tokens"] == 0 and noisy["measured_speedup_over_plain"]["3x6"] > 1.1
    assert "within the noise" in noisy["unsettled"]  # the noise decided: tuned again at the next loads
    seconds["tree"] = [0.5, 0.52, 0.49, 0.51, 0.5, 0.5]  # twice as fast, steadily
    choice = autotune.tune(gen, budget_s=3.0)
    assert choice["total_tokens"] > 0 and "measured fastest, 2.0" in choice["reason"] and "unsettled" not in choice
    assert autotune.paired_speedup([1.0, 1.0, 1.0], [0.5, 0.5, 1.0]) == (2.0, 0.0)


def test_progress_bars_write_a_line_at_start_and_end_in_a_log_file():
    import io

    from griffin.progress import progress

    log = io.StringIO()  # not a terminal
    bar = progress(total=200, desc="tuning", unit="s", file=log)
    for _ in range(200):
        bar.update(1)
    bar.close()
    bar.close()
    assert log.getvalue().splitlines() == ["tuning: started (200 s)", "tuning: finished in 0 s"]
    for _ in progress(range(5), desc="quiet", file=log, disable=True):
        pass
    assert "quiet" not in log.getvalue()


@pytest.mark.parametrize("imported", ["before", "inside"])
@pytest.mark.parametrize("setting", [None, "0"])
def test_hugging_face_bars_stay_out_of_a_commands_log_unless_asked_for(imported, setting):
    """A command whose stderr is a log file writes no "Loading weights" redraws, whether transformers was imported
    before the command started or during it; ``HF_HUB_DISABLE_PROGRESS_BARS=0`` keeps the bars."""
    import subprocess

    bar = "from transformers.utils import logging as hf; sum(hf.tqdm(range(3), desc={!r}))"
    main = f"def main(argv):\n    {bar.format('Loading weights')}\n    return 0\n"
    code = (bar.format("Before the command") + "\n" if imported == "before" else "") + main
    code += "from griffin.cli import run_cli\nrun_cli(main)\n"
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    if setting is not None:
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = setting
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert ("Before the command" in res.stderr) == (imported == "before"), res.stderr  # bars draw until told not to
    assert ("Loading weights" in res.stderr) == (setting == "0"), res.stderr


def test_progress_bars_in_a_log_file_write_a_status_line_every_few_minutes(monkeypatch):
    """Where a terminal shows a live bar, a log file gets a status line at most every ``progress.EVERY`` seconds: what
    is done of the total, the rate of this run since the line before (a resumed bar starts at its ``initial``), the
    time left and the postfix; iterating a bar to its end closes it."""
    import io
    import itertools

    from griffin import progress as module

    clock = itertools.count(0, 100)  # each perf_counter call is 100 s after the one before
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock))
    log = io.StringIO()
    items = list(module.progress(range(4), desc="train", unit="upd", file=log, initial=2, total=6))
    assert items == [0, 1, 2, 3]
    lines = log.getvalue().splitlines()
    assert lines[0] == "train: started (6 upd)" and lines[-1] == "train: finished in 500 s"
    assert len(lines) == 3  # with EVERY at 300 s: one status line among four updates 100 s apart
    assert lines[1] == "train: 5/6 upd after 300 s (0.01 upd/s, about 100 s left)"
    log = io.StringIO()
    monkeypatch.setattr(module.progress, "EVERY", 0.0)
    bar = module.progress(total=4, desc="features", unit="conv", file=log)
    bar.set_postfix(tok_s="812")
    bar.update(2)
    bar.close()
    assert "features: 2/4 conv after" in log.getvalue() and "s left; tok_s=812)" in log.getvalue()
    log = io.StringIO()  # records of parts answered before, or by others, count as done but not in the rate
    bar = module.progress(total=10, desc="regenerate", unit="rec", file=log)
    bar.skip(6)
    bar.update(2)
    bar.close()
    assert log.getvalue().splitlines()[1:3] == ["regenerate: 6/10 rec after 100 s (0 rec/s)",
                                                "regenerate: 8/10 rec after 200 s (0.02 rec/s, about 100 s left)"]
    times = iter([0, 100, 200, 300, 3900, 4000, 4100, 4200, 4300, 4400])  # start, 3 items, an hour's pause, 5 items
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(times))
    monkeypatch.setattr(module.progress, "EVERY", 250.0)
    log = io.StringIO()
    list(module.progress(range(8), desc="features", unit="conv", file=log))
    lines = log.getvalue().splitlines()  # each line's rate is that since the line before: the pause misleads one
    assert lines[1:4] == ["features: 3/8 conv after 300 s (0.01 conv/s, about 500 s left)",
                          "features: 4/8 conv after 3900 s (0.000278 conv/s, about 14400 s left)",
                          "features: 7/8 conv after 4200 s (0.01 conv/s, about 100 s left)"]


@pytest.mark.parametrize("batch", [False, True], ids=["one prompt", "batch of 2"])
def test_a_choice_the_machine_s_load_decided_is_tuned_again_at_the_next_loads_three_times_at_most(
        tmp_path, monkeypatch, caplog, batch):
    """A record marked unsettled (the plain loop kept because a faster tree was within the noise) is measured again at
    every read until it settles or has been tuned SETTLE_TRIES times; a settled record is kept; --retune starts the
    count again."""
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    target = tiny_model("llama", vocab_size=64)
    gen = SpecGenerator(target, CharTokenizer(), DraftModel(DraftConfig.from_target(target.config)), total_tokens=3)
    outcomes = []  # what each tuning returns, in turn

    def tuned(gen, *args, **kwargs):
        return dict(outcomes.pop(0), top_k=gen.top_k, tuning_s=0.0, reason="stubbed")

    if batch:
        monkeypatch.setattr(autotune, "tune_batch", tuned)

        def load(retune=False):
            autotune.autotune_batch(gen, 2, retune=retune)
            return autotune.batch_tuning_record(gen, 2)
    else:
        monkeypatch.setattr(autotune, "tune", tuned)

        def load(retune=False):
            return autotune.tuned_choice(gen, retune=retune)

    noisy = {"depth": 1, "total_tokens": 0, "unsettled": "a tree measured faster, within the noise"}
    outcomes.extend([noisy] * 4)
    caplog.set_level(logging.INFO, logger="griffin.autotune")
    assert [load()["tries"] for _ in range(5)] == [1, 2, 3, 3, 3]  # tuned three times, then kept as it is
    assert len(outcomes) == 1 and "decided by the machine's load" in caplog.text
    assert batch or "the machine's load decided it at all 3 tunings" in caplog.text
    assert load(retune=True)["tries"] == 1 and not outcomes
    outcomes.extend([{"depth": 2, "total_tokens": 4}, noisy])
    assert load()["tries"] == 2 and load()["total_tokens"] == 4  # settled at the second tuning: kept from then on
    assert len(outcomes) == 1
