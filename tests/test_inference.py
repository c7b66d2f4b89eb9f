"""Tree auto-tuning and the speed-run command."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from griffin import DraftConfig, DraftModel, SpecGenerator, autotune
from griffin.autotune import expected_tau
from griffin.tree import build_tree
from tests.conftest import ROOT, run_main, run_module, tiny_model


def chain_tree(length: int):
    """A root, a chain of `length` nodes with falling scores, and a depth-1 sibling ranked second."""
    # candidates in level order: chain node 1, the sibling, chain nodes 2..length
    tokens = torch.arange(length + 1)
    scores = torch.tensor([-0.1, -0.15] + [-0.1 * (i + 1) for i in range(1, length)])
    parents = torch.tensor([-1, -1, 0] + list(range(2, length)))
    levels = torch.tensor([1, 1] + list(range(2, length + 1)))
    return build_tree(torch.tensor([99]), tokens, scores, parents, levels, total_tokens=length + 1)


def test_expected_tau_counts_the_path_inside_smaller_trees():
    tree = chain_tree(4)  # node ids: 1 (depth 1), 2 (sibling, depth 1), 3, 4, 5
    assert tree.depths.tolist() == [0, 1, 1, 2, 3, 4]
    path = torch.tensor([0, 1, 3, 4])  # the target accepted three chain nodes
    trace = [(tree, path)]
    assert expected_tau(trace, total=5, depth=8) == 4  # 3 accepted + the bonus token
    assert expected_tau(trace, total=5, depth=2) == 3  # depth 2 cuts after two nodes
    assert expected_tau(trace, total=2, depth=8) == 2  # the 2 best nodes: chain node 1 and the sibling
    assert expected_tau(trace, total=3, depth=8) == 3


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


def fake_result(bench: str, draft: str, temperature: float, tau: float, digest: str = "") -> dict:
    return {"bench": bench, "target": "smollm2-135m-instruct", "draft": draft, "draft_digest": digest,
            "temperature": temperature,
            "max_new_tokens": 128, "n_prompts": 80, "tau": tau, "tokens_per_s": 30.0, "speedup": 2.0,
            "baseline_tokens_per_s": 15.0, "own_loop_tokens_per_s": 20.0, "peers": {"prompt_lookup": 1.1},
            "prompt_lookup_tokens_per_s": 18.0,
            "identical_fraction": 1.0,
            "tree": {"depth": 5, "top_k": 8, "total_tokens": 24}, "command": f"python -m inference.speed {bench}",
            "machine": {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "torch": "2.13", "date": "today",
                        "torch_threads": 1},
            "per_prompt": [{"question_id": 1, "turn": 0, "tau": tau - 0.1},
                           {"question_id": 2, "turn": 0, "tau": tau + 0.1}]}  # standard error 0.1


def fake_heads(checkpoints: Path, suffixes) -> dict[str, str]:
    """Head folders whose files differ only in one byte -> {suffix: weights digest}."""
    from griffin.io import weights_digest

    digests = {}
    for i, suffix in enumerate(suffixes):
        folder = checkpoints / f"smollm2-135m-instruct-{suffix}"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(bytes([i]))
        digests[suffix] = weights_digest(folder)
    return digests


def test_ablation_report_and_readme_section_count_only_runs_of_the_present_weights(tmp_path, capsys):
    from inference import ablation, headline

    results, checkpoints = tmp_path / "results", tmp_path / "checkpoints"
    (results / "ablation").mkdir(parents=True)
    digests = fake_heads(checkpoints, ablation.HEADS.values())
    for i, suffix in enumerate(ablation.HEADS.values()):
        for bench in ("mt_bench", "humaneval", "gsm8k"):
            for t in (0, 1):
                name = f"{bench}-smollm2-135m-instruct-{suffix}-T{t}.json"
                (results / "ablation" / name).write_text(json.dumps(fake_result(bench, suffix, float(t),
                                                                                3.0 - 0.2 * i, digests[suffix])))
                if suffix == "griffin":  # the headline runs of the shipped head
                    (results / name).write_text(json.dumps(fake_result(bench, suffix, float(t), 3.5,
                                                                       digests[suffix])))
    stale = fake_result("mt_bench", "griffin-lookup10", 0.0, 9.0, "an earlier head")  # same name, other weights
    (results / "mt_bench-smollm2-135m-instruct-griffin-lookup10-T0.json").write_text(json.dumps(stale))
    (results / "ablation" / "mt_bench-smollm2-135m-instruct-hass-T0.json").write_text(
        json.dumps(fake_result("mt_bench", "hass", 0.0, 9.0, "an earlier head")))
    assert ablation.main(["--results", str(results / "ablation"), "--report", str(results / "ablation.md"),
                          "--checkpoints", str(checkpoints)]) == 0
    assert "left out 1 runs" in capsys.readouterr().out
    report = (results / "ablation.md").read_text()
    assert "| GRIFFIN | 3.00 ± 0.10 |" in report and "1.364x" in report  # 3.0 / 2.2 against EAGLE-2
    assert "| HASS (eagle, K=3, no mask) | - | 2.40 ± 0.10 |" in report  # its stale mt_bench run left out
    assert "| EAGLE-2 (eagle, K=1) | +0.800 ± 0.000 (1.364x) |" in report  # paired by question and turn
    assert (results / "ablation.png").stat().st_size > 1000
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results:start -->\nold\n<!-- results:end -->\nrest\n")
    assert headline.main(["--readme", str(readme), "--results", str(results), "--checkpoints", str(checkpoints)]) == 0
    assert "left out 1 runs of other weights" in capsys.readouterr().out
    text = readme.read_text()
    assert "old" not in text and text.endswith("rest\n") and "9.00" not in text
    assert ("| mt_bench | 0.00 | fp32 | Intel Xeon | 1 | 80 | 128 | 24 nodes, depth 5 | 3.50 | **1.50x** (own loop) | "
            "2.00x |") in text  # the CPU without trademark signs
    assert "| 20.0 (linear) | 1.20x | 1.00 |" in text  # prompt lookup: a ratio of tokens/s (18 / 15), not of times
    assert "| GRIFFIN | 3.00 ± 0.10 |" in text and "+0.800 ± 0.000" not in text  # the τ table, not the paired one
    from inference.report import result_stem

    assert result_stem("gsm8k", "h", 0.0, "fp32") == "gsm8k-h-T0" and result_stem("gsm8k", "h", 1.0, "bf16") == \
        "gsm8k-h-T1-bf16"
    assert "ablation.md)" in text and "| GRIFFIN | 3.00 ± 0.10 |" in text


def test_ablation_from_replays_runs_every_head_at_once_and_pairs_griffin_with_each(tmp_path, monkeypatch):
    from inference import ablation, tau

    checkpoints = tmp_path / "checkpoints"
    digests = fake_heads(checkpoints, ablation.HEADS.values())
    calls = []

    def fake_tau(argv):  # writes what inference.tau writes: one file per bench and T with every head in it
        calls.append(argv)
        heads = argv[argv.index("--heads") + 1: argv.index("--bench")]
        t = argv[argv.index("--temperatures") + 1]
        out = Path(argv[argv.index("--out") + 1])
        result = {"command": "python -m inference.tau " + " ".join(argv), "max_new_tokens": 128,
                  "tree": {"depth": 5, "top_k": 8, "total_tokens": 24}, "heads": {},
                  "head_digests": {Path(h).name: digests[Path(h).name.removeprefix("smollm2-135m-instruct-")]
                                   for h in heads}}
        for i, head in enumerate(heads):
            per_prompt = [{"question_id": q, "turn": 0, "tau": 3.0 - 0.2 * i + 0.1 * q} for q in range(4)]
            result["heads"][Path(head).name] = {t: {"tau": 3.15 - 0.2 * i, "n_prompts": 4, "per_prompt": per_prompt}}
        out.with_suffix(".json").write_text(json.dumps(result))
        return 0

    monkeypatch.setattr(tau, "main", fake_tau)
    results, report = tmp_path / "ablation", tmp_path / "ablation.md"
    results.mkdir()
    common = ["--replay", "--results", str(results), "--report", str(report), "--benches", "mt_bench,gsm8k",
              "--checkpoints", str(checkpoints)]
    assert ablation.main(["--run", *common, "--threads", "2"]) == 0
    assert len(calls) == 4 and all(len(argv[argv.index("--heads") + 1: argv.index("--bench")]) == 5 for argv in calls)
    limits = {(a[a.index("--bench") + 1], a[a.index("--temperatures") + 1]): a[a.index("--limit") + 1]
              if "--limit" in a else None for a in calls}
    assert limits == {("mt_bench", "0"): None, ("gsm8k", "0"): "20", ("mt_bench", "1"): "20", ("gsm8k", "1"): "20"}
    text = report.read_text()
    assert "offline replays" in text and "| GRIFFIN | 3.15 ± 0.06 |" in text
    assert "| EAGLE-2 (eagle, K=1) | +0.800 ± 0.000 (1.340x) |" in text  # 3.15 / 2.35, paired prompt by prompt
    assert ablation.main(["--run", *common]) == 0 and len(calls) == 4  # nothing missing: nothing rerun
    (checkpoints / "smollm2-135m-instruct-eagle2" / "model.safetensors").write_bytes(b"retrained")
    assert ablation.main(common) == 0 and "| EAGLE-2" not in report.read_text()  # its replays are of other weights
    with pytest.raises(FileNotFoundError, match="run with --run first$"):  # no speed runs there
        ablation.main(common[1:])


def test_machine_line_names_the_vector_extensions_and_the_headline_marks_amx():
    from griffin.kernels import VECTOR_FLAGS, cpu_flags
    from inference.headline import cpu_text
    from inference.report import machine_info, machine_text

    assert set(cpu_flags()) <= set(VECTOR_FLAGS) and machine_info()["cpu_flags"] == cpu_flags()
    xeon = {"cpu": "Intel(R) Xeon(R) Platinum 8481C CPU", "cores": 2, "torch": "2.13", "date": "today",
            "cpu_flags": ["avx512f", "amx_tile", "amx_bf16"], "torch_threads": 1}
    assert machine_text(xeon) == ("Intel(R) Xeon(R) Platinum 8481C CPU (avx512f, amx_tile, amx_bf16), 2 cores, "
                                  "1 torch threads, torch 2.13, today")
    assert cpu_text(xeon) == "Intel Xeon Platinum 8481C CPU (AMX)"
    old = {"cpu": "AMD EPYC", "cores": 2, "torch": "2.13", "date": "today"}  # written before cpu_flags existed
    assert machine_text(old) == "AMD EPYC, 2 cores, torch 2.13, today" and cpu_text(old) == "AMD EPYC"


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
    assert export.main([str(src), str(dst), "--name", "GRIFFIN", "--results", str(results)]) == 0  # refresh the card
    assert DraftModel.from_pretrained(dst).config == head.config
    from safetensors import safe_open

    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fusion.fc.weight").dtype == torch.float16
    card = (dst / "README.md").read_text()
    assert card.startswith("# GRIFFIN draft head for tiny") and "| 1 | 0.50 | 0.70 | 1.00 | 1.00 |" in card
    assert "3.10" in card and "python -m inference.speed mt_bench" in card
    assert "9.00" not in card and "gsm8k" not in card  # a run of an earlier head exported to the same folder


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


def test_engine_benchmark_on_a_tiny_target(tmp_path, tiny_target_dir):
    res = run_module("inference.engine", "--target", str(tiny_target_dir), "--max-new-tokens", "12", "--max-chain",
                     "2", "--draft-vocab", "0", "--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    result = json.loads((tmp_path / "engine.json").read_text())
    assert set(result["oracle"]) == {"oracle_tree", "oracle_chain_1", "oracle_chain_2"}
    assert result["oracle"]["oracle_chain_2"]["tau"] > result["oracle"]["oracle_chain_1"]["tau"] > 1
    assert result["untrained_cycle_s"] > 0 and result["forward_cost_s"]["F.linear"]["1"] > 0
    assert min(result["untrained_cycle_split_s"].values()) > 0
    assert "## Ceiling" in (tmp_path / "engine.md").read_text()


def test_verify_profile_groups_the_operators_of_one_forward(tmp_path, tiny_target_dir):
    from inference import verify_profile

    assert verify_profile.main(["--target", str(tiny_target_dir), "--tokens", "1,3", "--repeats", "2",
                                "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "verify-profile.json").read_text())
    assert set(result["runs"]) == {"1", "3"}
    for run in result["runs"].values():
        groups = run["groups_s"]
        assert groups["matrix products"] > 0 and groups["attention"] > 0
        assert sum(groups.values()) <= run["profiled_s"] * 1.01
        assert run["ops_per_forward"] > 10
    assert result["linear_weight_bytes"] > 0
    assert "matrix products' weight bandwidth" in (tmp_path / "verify-profile.md").read_text()
    for matmul in ("aten::mm", "mkldnn::_linear_pointwise"):  # the latter: the oneDNN kernel
        assert verify_profile.group_of(matmul) == "matrix products"
    assert verify_profile.group_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert verify_profile.group_of("aten::copy_") == "copies and views"
    assert verify_profile.group_of("aten::rsqrt").startswith("elementwise")


def test_gpu_check_script_runs_the_benchmark_at_the_tiny_shape(tmp_path):
    """inference/gpu_check.sh as the lead runs it on a GPU machine, at the tiny shape (its CUDA tests left out)."""
    import subprocess

    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_TINY": "1", "GPU_CHECK_TESTS": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    res = subprocess.run(["bash", "inference/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    log = (tmp_path / "bench.log").read_text() if (tmp_path / "bench.log").exists() else ""
    assert res.returncode == 0, res.stdout + log[-3000:]
    assert "benchmark tiny: ok" in res.stdout and "torch" in res.stdout
    shape = json.loads((tmp_path / "engine-cpu.json").read_text())["shapes"]["tiny"]
    assert shape["complete"] and shape["dtype"] == "fp32" and shape["parameters"] == 106_816
    oracle = shape["oracle"]
    assert set(oracle) == {"1", "6", "60"}
    # 24 new tokens: one from the prefill, then cycles of 2 tokens (1 node) or 7 (depth 6), the last one cut
    assert oracle["1"]["tau"] == 2.0 and oracle["6"]["tau"] == oracle["60"]["tau"] == 6.0
    for o in oracle.values():
        assert o["identical_to_generate"] == 1.0 and o["oracle_runs"] == 1 and o["ceiling"] > 0
    untrained = shape["untrained"]
    assert untrained["cycles"] > 0 and untrained["identical_to_generate"] == 1.0
    assert min(untrained["draft_s"], untrained["verify_s"], untrained["other_s"]) > 0
    assert {"1", "2", "7", "61"} <= set(shape["forward_cost_s"]) and shape["autotune"]["total_tokens"] >= 0
    table = (tmp_path / "engine-cpu.md").read_text()
    assert "## tiny" in table and "Engine overhead at the 60-node tree" in table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.log", "engine-cpu.json", "engine-cpu.md",
                                                          "summary.txt"]


def test_gpu_engine_oracle_reproposes_the_engines_own_tokens():
    from inference.gpu_engine import IdTokenizer, oracle_generate

    target = tiny_model("llama", vocab_size=96)
    torch.manual_seed(0)
    head = DraftModel(DraftConfig.from_target(target.config))
    gen = SpecGenerator(target, IdTokenizer(96), head, depth=6, top_k=10, total_tokens=60)
    ids = torch.tensor([5, 17, 33, 2])
    ref = target.generate(ids[None], max_new_tokens=20, do_sample=False)[0, 4:].tolist()
    stats, _, runs, same = oracle_generate(gen, ids, ref, 60, 20, passes=4)
    assert (runs, same) == (1, True) and stats.tau > 4
    wrong = ref[:8] + [(t + 1) % 96 for t in ref[8:]]  # as if the engine rounded a near-tie differently at 8
    stats, _, runs, same = oracle_generate(gen, ids, wrong, 60, 20, passes=4)
    assert (runs, same) == (2, True) and stats.tau > 4
    code, err = run_main("inference.gpu_engine", "--shapes", "tiny,bogus")
    assert code == 2 and "unknown shape(s) ['bogus']" in err


def test_identity_reports_the_first_divergence_and_its_margin_in_rounding_steps():
    from inference.identity import first_divergence, ulp

    assert ulp(1.0, torch.bfloat16) == 2**-7 and ulp(20.0, torch.bfloat16) == 0.125
    assert ulp(1.0, torch.float32) == 2**-23
    logits = torch.zeros(4, 6, dtype=torch.bfloat16)
    logits[2, 3], logits[2, 5] = 20.0, 19.75  # generate chose 3 at step 2; token 5 was two bf16 steps below
    assert first_divergence([1, 2, 3, 4], [1, 2, 3, 4], logits, torch.bfloat16) is None
    found = first_divergence([1, 2, 3, 4], [1, 2, 5, 0], logits, torch.bfloat16)
    assert found == {"position": 2, "margin": 0.25, "margin_ulp": 2.0}
    assert first_divergence([1, 2, 3], [1, 2], logits, torch.bfloat16) == {"position": 2, "margin": None,
                                                                           "margin_ulp": None}


COMMANDS = ["training.build_features", "training.train", "training.export", "training.regenerate",
            "training.throughput", "training.distill", "training.recipe", "inference.demo", "inference.chat",
            "inference.speed", "inference.ablation", "inference.engine", "inference.headline",
            "inference.verify_profile", "inference.tau", "inference.distill_heads", "inference.distill_lm",
            "inference.gpu_engine", "inference.plain_kernel", "inference.identity", "inference.greedy_pick",
            "inference.learning_curve"]
HELP_WITHOUT_TORCH = """
import contextlib, io, runpy, sys
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            assert exit_.code == 0, (module, exit_.code)
    assert "usage: python -m " + module in out.getvalue(), module
    heavy = sorted(m for m in ("torch", "transformers", "safetensors.torch", "accelerate") if m in sys.modules)
    print(module, heavy)
"""


def test_every_command_answers_help_before_loading_torch():
    """--help (and usage errors) answer in a fraction of a second: nothing heavy is imported before parsing."""
    res = run_module("-c", HELP_WITHOUT_TORCH, *COMMANDS, launcher=[sys.executable])
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"{module} []" for module in COMMANDS]


def test_distill_lm_report_shows_learning_curves_and_the_training_text_nll(tmp_path):
    from inference.distill_lm import plot, report, target_nll_summary

    def student(curve: list[float], nll: float | None) -> dict:
        nlls = {} if nll is None else {"train_target_nll_first": nll - 0.5, "train_target_nll_last": nll + 0.5}
        return {"description": "d", "steps": 50, "val_acceptance": curve[-1], "train_target_nll": nll, **nlls,
                "val_curve": [{"updates": 25 * i, "acceptance": a, "positions": 9} for i, a in enumerate(curve)],
                "T0": {"alpha": 0.2, "tau": 1.2, "identical_fraction": 1.0}, "T1": {"alpha": 0.3, "tau": 1.3}}

    result = {"settings": {"layers": 2, "draft_vocab": 64, "steps": 50, "batch_size": 4, "gen_len": 8, "lr": 3e-3,
                           "max_new_tokens": 8, "gamma": 3},
              "question_ids": [81], "best_student": "fixed", "command": "cmd", "train_minutes": 1.0,
              "wall_minutes": 1.0, "load_average_before_speed": 0.5, "load_average_after_speed": 0.5,
              "machine": {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "torch": "2.13", "date": "today"},
              "students": {"undistilled": student([0.06, 0.06], None), "fixed": student([0.06, 0.18, 0.25], 1.86),
                           "online": student([0.06, 0.06, 0.17], 7.5)},
              "speed": {"fastest_plain": "plain", "methods": {"plain": {"tokens_per_s": 12.0, "tau": 1.0,
                                                                       "speedup_vs_fastest_plain": 1.0,
                                                                       "identical_fraction": 1.0}},
                        "costs": {"draft_step_s": 0.006, "draft_step_vs_target_step": 0.07,
                                  "target_forward_s": {"1": 0.09, "2": 0.1}, "break_even_alpha": {"1": 0.01}}}}
    text = report(result)
    assert "| fixed | 0.060 | 0.180 | 0.250 |" in text and "| online | 0.060 | 0.060 | 0.170 |" in text
    assert "| undistilled |" in text.split("as training goes")[0]
    assert "| 7.50 (first 10 updates 7.00, last 10 8.00) |" in text  # the NLL column
    history = [{"target_nll": float(i)} for i in range(30)] + [{"loss": 1.0}]
    assert target_nll_summary(history) == {"train_target_nll": 14.5, "train_target_nll_first": 4.5,
                                           "train_target_nll_last": 24.5}
    plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


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
    seconds.update({autotune.NO_TREE: [1.0], "tree": [2.0]})  # every tree is slower
    choice = autotune.tune(gen, budget_s=3.0)
    assert (choice["depth"], choice["total_tokens"]) == autotune.NO_TREE and autotune.NO_TREE in timed
    assert choice["reason"].startswith("the plain loop: no tree beat it")
    assert "the default tree 0.50x" in choice["reason"]
    seconds["tree"] = [0.99]  # 1 % faster: within MIN_GAIN
    assert autotune.tune(gen, budget_s=3.0)["total_tokens"] == 0
    seconds["tree"] = [1 / 1.5, 1 / 0.8, 1 / 1.4, 1 / 0.9, 1 / 1.3, 1.0]  # a median of 1.15x, but far from steady
    noisy = autotune.tune(gen, budget_s=3.0)
    assert noisy["total_tokens"] == 0 and noisy["measured_speedup_over_plain"]["3x6"] > 1.1
    seconds["tree"] = [0.5, 0.52, 0.49, 0.51, 0.5, 0.5]  # twice as fast, steadily
    choice = autotune.tune(gen, budget_s=3.0)
    assert choice["total_tokens"] > 0 and "measured fastest, 2.0" in choice["reason"]
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
