"""The studies under benchmarks/: their reports from fake runs, and the engine benchmarks at tiny sizes."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from griffin import DraftConfig, DraftModel, SpecGenerator
from tests.conftest import ROOT, fake_result, run_main, run_module, tiny_model


def fake_heads(checkpoints: Path, suffixes) -> dict[str, str]:
    """Head folders whose files differ only in one byte -> {suffix: weights digest}."""
    from griffin.io import weights_digest

    digests = {}
    for i, suffix in enumerate(suffixes):
        folder = checkpoints / f"smollm2-135m-instruct-{suffix}"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(bytes([i]))
        if i == 0:  # the first head records what it trained on, as every trained checkpoint does
            stages = [{"epochs": [{"tokens": 15_000_000}, {"tokens": 757_824}]}, {"epochs": [{"tokens": 0}]}]
            (folder / "stages.json").write_text(json.dumps(stages))
        digests[suffix] = weights_digest(folder)
    return digests


def test_ablation_report_and_readme_section_count_only_runs_of_the_present_weights(tmp_path, capsys):
    from benchmarks import ablation, headline

    results, checkpoints = tmp_path / "results", tmp_path / "checkpoints"
    (results / "ablation").mkdir(parents=True)
    digests = fake_heads(checkpoints, ablation.HEADS.values())
    for i, suffix in enumerate(ablation.HEADS.values()):
        for bench in ("mt_bench", "humaneval", "gsm8k"):
            for t in (0, 1):
                name = f"{bench}-smollm2-135m-instruct-{suffix.replace('/', '-')}-T{t}.json"
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
    assert "| GRIFFIN | 15.76M | 3.00 ± 0.10 |" in report and "1.364x" in report  # 3.0 / 2.2 against EAGLE-2
    assert "| HASS (eagle, K=3, no mask) | - | - | 2.40 ± 0.10 |" in report  # its stale mt_bench run left out
    assert "| EAGLE-2 (eagle, K=1) | +0.800 ± 0.000 (1.364x) |" in report  # paired by question and turn
    assert "## GRIFFIN on EAGLE-3 (griffin3, TTT 7) against EAGLE-3 (eagle3, TTT 7), paired" in report
    assert "| EAGLE-3 (eagle3, TTT 7) | -0.200 ± 0.000 (0.900x) |" in report  # 1.8 - 2.0
    assert (results / "ablation.png").stat().st_size > 1000
    readme = tmp_path / "bench" / "README.md"
    readme.parent.mkdir()
    readme.write_text("intro\n<!-- results:start -->\nold\n<!-- results:end -->\nrest\n")
    assert headline.main(["--readme", str(readme), "--results", str(results), "--checkpoints", str(checkpoints)]) == 0
    assert "left out 1 runs of other weights" in capsys.readouterr().out
    text = readme.read_text()
    assert "old" not in text and text.endswith("rest\n") and "9.00" not in text
    assert ("| mt_bench | 0.00 | fp32 | Intel Xeon | 1 | 80 | 128 | 24 nodes, depth 5 | 3.50 | **1.50x** (own loop) | "
            "2.00x |") in text  # the CPU without trademark signs
    assert "| 20.0 (linear) | 1.20x | 1.00 |" in text  # prompt lookup: a ratio of tokens/s (18 / 15), not of times
    assert "| GRIFFIN | 15.76M | 3.00 ± 0.10 |" in text and "+0.800 ± 0.000" not in text  # the τ table only
    from griffin.report import result_stem

    assert result_stem("gsm8k", "h", 0.0, "fp32") == "gsm8k-h-T0" and result_stem("gsm8k", "h", 1.0, "bf16") == \
        "gsm8k-h-T1-bf16"
    assert "](../results/ablation.md)" in text and "| GRIFFIN | 15.76M | 3.00 ± 0.10 |" in text  # links from the readme
    assert "[json](../results/mt_bench-smollm2-135m-instruct-griffin-T0.json)" in text


def test_committed_reports_are_what_the_committed_runs_and_heads_give(tmp_path, monkeypatch):
    """ablation.md and the results section of benchmarks/README.md, rebuilt from the committed runs and checkpoints,
    equal the committed files: a head's new weights committed without a rerun of its rows (whose runs then no
    longer count) or a result committed without its report fails here."""
    from benchmarks import ablation, headline

    (tmp_path / "benchmarks").mkdir()  # the repository layout, the committed files linked in, the reports written here
    (tmp_path / "benchmarks" / "results").symlink_to(ROOT / "benchmarks" / "results")
    (tmp_path / "checkpoints").symlink_to(ROOT / "checkpoints")
    readme = tmp_path / "benchmarks" / "README.md"
    readme.write_text((ROOT / "benchmarks" / "README.md").read_text())
    monkeypatch.chdir(tmp_path)
    assert ablation.main(["--replay", "--report", "ablation.md"]) == 0
    assert Path("ablation.md").read_text() == (ROOT / "benchmarks" / "results" / "ablation.md").read_text(), \
        "benchmarks/results/ablation.md is stale: python -m benchmarks.ablation --run --replay"
    assert headline.main([]) == 0
    assert readme.read_text() == (ROOT / "benchmarks" / "README.md").read_text(), \
        "the results section of benchmarks/README.md is stale: python -m benchmarks.headline"


def test_ablation_from_replays_runs_every_head_at_once_and_pairs_griffin_with_each(tmp_path, monkeypatch):
    from benchmarks import ablation
    from inference import tau

    checkpoints = tmp_path / "checkpoints"
    digests = fake_heads(checkpoints, ablation.HEADS.values())
    by_name = {ablation.head_folder(argparse.Namespace(checkpoints=checkpoints, target="smollm2-135m-instruct"),
                                    suffix).name: digest for suffix, digest in digests.items()}
    calls = []

    def fake_tau(argv):  # writes what inference.tau writes: one file per bench and T with every head in it
        calls.append(argv)
        heads = argv[argv.index("--heads") + 1: argv.index("--bench")]
        t = argv[argv.index("--temperatures") + 1]
        out = Path(argv[argv.index("--out") + 1])
        result = {"command": "python -m inference.tau " + " ".join(argv), "max_new_tokens": 128,
                  "tree": {"depth": 5, "top_k": 8, "total_tokens": 24}, "heads": {}, "draft_dtype": "float32",
                  "machine": {"cpu": f"CPU {len(calls)}"}, "seconds": 10.0,
                  "head_digests": {Path(h).name: by_name[Path(h).name] for h in heads}}
        for i, head in enumerate(heads):
            shift = 0.01 * len(calls)  # every replay measures a little differently, so a pairing shows its source
            taus = [3.0 - 0.2 * i + 0.1 * q + shift for q in range(4)]
            per_prompt = [{"question_id": q, "turn": 0, "tau": t, "new_tokens": 100 * t, "cycles": 100}
                          for q, t in enumerate(taus)]
            result["heads"][Path(head).name] = {t: {"tau": 3.15 - 0.2 * i + shift, "n_prompts": 4,
                                                    "per_prompt": per_prompt}}
        out.with_suffix(".json").write_text(json.dumps(result))
        return 0

    monkeypatch.setattr(tau, "main", fake_tau)
    results, report = tmp_path / "ablation", tmp_path / "ablation.md"
    results.mkdir()
    common = ["--replay", "--results", str(results), "--report", str(report), "--benches",
              "mt_bench,gsm8k,extra_tasks", "--checkpoints", str(checkpoints)]
    assert ablation.main(["--run", *common, "--threads", "2"]) == 0
    assert len(calls) == 5 and all(len(argv[argv.index("--heads") + 1: argv.index("--bench")]) == 7 for argv in calls)
    limits = {(a[a.index("--bench") + 1], a[a.index("--temperatures") + 1]): a[a.index("--limit") + 1]
              if "--limit" in a else None for a in calls}
    assert limits == {("mt_bench", "0"): None, ("gsm8k", "0"): "20", ("extra_tasks", "0"): None,  # greedy tasks: T=0
                      ("mt_bench", "1"): "20", ("gsm8k", "1"): "20"}
    text = report.read_text()
    assert "offline replays" in text and "| GRIFFIN | 15.76M | 3.16 ± 0.06 |" in text
    assert "| EAGLE-2 (eagle, K=1) | +0.800 ± 0.000 (1.339x) |" in text  # 3.16 / 2.36, paired prompt by prompt
    assert "| extra_tasks T=0 (4) | mt_bench T=1 (4) |" in text  # the extra tasks' column, at T=0 only
    assert ablation.main(["--run", *common]) == 0 and len(calls) == 5  # nothing missing: nothing rerun
    (checkpoints / "smollm2-135m-instruct-eagle2" / "model.safetensors").write_bytes(b"retrained")
    assert ablation.main(common) == 0 and "| EAGLE-2" not in report.read_text()  # its replays are of other weights
    # a retrained (or added) head replays in a file of its own, beside a GRIFFIN rerun it is paired with
    by_name["smollm2-135m-instruct-eagle2"] = ablation.weights_digest(checkpoints / "smollm2-135m-instruct-eagle2")
    assert ablation.main(["--run", *common, "--benches", "mt_bench"]) == 0 and len(calls) == 7
    assert [Path(a[a.index("--heads") + 1]).name for a in calls[5:]] == ["smollm2-135m-instruct-griffin"] * 2
    assert (results / "tau-mt_bench-T0-eagle2.json").is_file() and not (results / "tau-gsm8k-T0-eagle2.json").exists()
    text = report.read_text()
    assert "| GRIFFIN | 15.76M | 3.16 ± 0.06 |" in text  # still from the first file
    assert "| EAGLE-2 (eagle, K=1) | +0.200 ± 0.000 (1.066x) | - | - | +0.200" in text  # 3.21 - 3.01 in its file
    assert "| `tau-mt_bench-T0-eagle2.json` | CPU 6 | float32 | EAGLE-2 (eagle, K=1) | 3.210 | 10 |" in text
    (checkpoints / "smollm2-135m-instruct-eagle2" / "model.safetensors").write_bytes(b"retrained twice")
    by_name["smollm2-135m-instruct-eagle2"] = ablation.weights_digest(checkpoints / "smollm2-135m-instruct-eagle2")
    assert ablation.main(["--run", *common, "--benches", "mt_bench", "--temperatures", "0"]) == 0 and len(calls) == 8
    assert (results / "tau-mt_bench-T0-eagle2.json").is_file()  # the earlier file is kept, not overwritten
    assert "| `tau-mt_bench-T0-eagle2-2.json` | CPU 8 |" in report.read_text()
    with pytest.raises(FileNotFoundError, match="run with --run first$"):  # no speed runs there
        ablation.main(common[1:])


def test_machine_line_names_the_vector_extensions_and_the_headline_marks_amx():
    from benchmarks.headline import cpu_text
    from griffin.kernels import VECTOR_FLAGS, cpu_flags
    from griffin.report import machine_info, machine_text

    assert set(cpu_flags()) <= set(VECTOR_FLAGS) and machine_info()["cpu_flags"] == cpu_flags()
    xeon = {"cpu": "Intel(R) Xeon(R) Platinum 8481C CPU", "cores": 2, "torch": "2.13", "date": "today",
            "cpu_flags": ["avx512f", "amx_tile", "amx_bf16"], "torch_threads": 1}
    assert machine_text(xeon) == ("Intel(R) Xeon(R) Platinum 8481C CPU (avx512f, amx_tile, amx_bf16), 2 cores, "
                                  "1 torch threads, torch 2.13, today")
    assert cpu_text(xeon) == "Intel Xeon Platinum 8481C CPU (AMX)"
    old = {"cpu": "AMD EPYC", "cores": 2, "torch": "2.13", "date": "today"}  # written before cpu_flags existed
    assert machine_text(old) == "AMD EPYC, 2 cores, torch 2.13, today" and cpu_text(old) == "AMD EPYC"


def test_engine_benchmark_on_a_tiny_target(tmp_path, tiny_target_dir):
    res = run_module("benchmarks.engine", "--target", str(tiny_target_dir), "--max-new-tokens", "12", "--max-chain",
                     "2", "--draft-vocab", "0", "--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    result = json.loads((tmp_path / "engine.json").read_text())
    assert set(result["oracle"]) == {"oracle_tree", "oracle_chain_1", "oracle_chain_2"}
    assert result["oracle"]["oracle_chain_2"]["tau"] > result["oracle"]["oracle_chain_1"]["tau"] > 1
    assert result["untrained_cycle_s"] > 0 and result["forward_cost_s"]["F.linear"]["1"] > 0
    assert min(result["untrained_cycle_split_s"].values()) > 0
    assert "## Ceiling" in (tmp_path / "engine.md").read_text()


def test_verify_profile_groups_the_operators_of_one_forward(tmp_path, tiny_target_dir):
    from benchmarks import verify_profile

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
    """benchmarks/gpu_check.sh as the lead runs it on a GPU machine, at the tiny shape (its CUDA tests left out)."""
    import subprocess

    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_TINY": "1", "GPU_CHECK_TESTS": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    res = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batching-cpu.json", "bench.log", "engine-cpu.json",
                                                          "summary.txt"]  # JSON only: a GPU machine returns 8 files
    batching = json.loads((tmp_path / "batching-cpu.json").read_text())
    assert set(batching["batches"]) == {"1", "2"} and batching["complete"]
    runs = [o for b in batching["batches"].values() for o in b["oracle"].values()]
    assert len(runs) == 8 and all(o["identical_to_plain"] and o["runs"] == 1 and o["tau"] > 1 for o in runs)
    for module, stem in (("benchmarks.gpu_engine", "engine-cpu"), ("benchmarks.gpu_batching", "batching-cpu")):
        assert run_main(module, "--table", str(tmp_path / f"{stem}.json"))[0] == 0
    table = (tmp_path / "engine-cpu.md").read_text()
    assert "## tiny" in table and "Engine overhead at the 60-node tree" in table
    assert "| 2 | " in (tmp_path / "batching-cpu.md").read_text()


def test_gpu_engine_oracle_reproposes_the_engines_own_tokens():
    from benchmarks.gpu_engine import IdTokenizer, oracle_generate

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
    code, err = run_main("benchmarks.gpu_engine", "--shapes", "tiny,bogus")
    assert code == 2 and "unknown shape(s) ['bogus']" in err


def test_identity_reports_the_first_divergence_and_its_margin_in_rounding_steps():
    from benchmarks.identity import first_divergence, ulp

    assert ulp(1.0, torch.bfloat16) == 2**-7 and ulp(20.0, torch.bfloat16) == 0.125
    assert ulp(1.0, torch.float32) == 2**-23
    logits = torch.zeros(4, 6, dtype=torch.bfloat16)
    logits[2, 3], logits[2, 5] = 20.0, 19.75  # generate chose 3 at step 2; token 5 was two bf16 steps below
    assert first_divergence([1, 2, 3, 4], [1, 2, 3, 4], logits, torch.bfloat16) is None
    found = first_divergence([1, 2, 3, 4], [1, 2, 5, 0], logits, torch.bfloat16)
    assert found == {"position": 2, "margin": 0.25, "margin_ulp": 2.0}
    assert first_divergence([1, 2, 3], [1, 2], logits, torch.bfloat16) == {"position": 2, "margin": None,
                                                                           "margin_ulp": None}


def test_distill_lm_report_shows_learning_curves_and_the_training_text_nll(tmp_path):
    from benchmarks.distill_lm import plot, report, target_nll_summary

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


def test_batching_benchmark_on_a_tiny_target(tmp_path, tiny_target_dir, head_dir):
    """Each batch size's throughput of the three methods, and every row of ours (trees with lookup chains) identical
    to its own B=1 output."""
    out = tmp_path / "batching"
    res = run_module("benchmarks.batching", "--target", str(tiny_target_dir), "--draft", str(head_dir),
                     "--total-tokens", "4", "--depth", "2", "--lookup", "3", "--batch-sizes", "1,2", "--dtypes", "fp32",
                     "--prompts", "2", "--max-new-tokens", "6", "--min-groups", "3", "--out", str(out))
    assert res.returncode == 0, res.stderr
    result = json.loads(out.with_suffix(".json").read_text())
    batches = result["runs"][0]["batches"]
    assert set(batches) == {"1", "2"}
    assert batches["2"]["tree"] == {"depth": 2, "total_tokens": 4}
    assert batches["2"]["rows_identical_to_b1"]["ours"] == 2 and min(batches["2"]["tokens_per_s"].values()) > 0
    # rounds over the groups until at least 3 are timed: 2 rounds of 2 at B=1, 3 rounds of 1 at B=2
    assert batches["1"]["group_speedup"]["groups"] == 4 and batches["1"]["group_speedup"]["se"] is not None
    assert batches["2"]["group_speedup"]["groups"] == 3 and batches["2"]["tokens"]["ours"] == 3 * 2 * 6
    alone = tmp_path / "batch-2-only"  # without batch 1 there is nothing to check rows against; second turns
    res = run_module("benchmarks.batching", "--target", str(tiny_target_dir), "--draft", str(head_dir),
                     "--total-tokens", "4", "--depth", "2", "--lookup", "3", "--batch-sizes", "2", "--dtypes", "fp32",
                     "--prompts", "2", "--max-new-tokens", "6", "--turn", "2", "--answer-tokens", "5",
                     "--min-groups", "1", "--out", str(alone))
    assert res.returncode == 0, res.stderr
    second = json.loads(alone.with_suffix(".json").read_text())["runs"][0]
    assert second["batches"]["2"]["rows_identical_to_b1"] is None
    assert second["batches"]["2"]["group_speedup"] | {"mean": 0} == {"mean": 0, "se": None, "groups": 1}
    first_turns = result["runs"][0]["prompt_tokens"]  # a second turn holds the first, its answer and the question
    assert all(n2 > n1 + 5 for n1, n2 in zip(first_turns, second["prompt_tokens"], strict=True))
    text = alone.with_suffix(".md").read_text()
    assert "| - | - |" in text and "second turns (after our plain loop's first answer of at most 5 tokens)" in text
    assert out.with_suffix(".png").is_file()
    assert "| 2 | 4 nodes, depth 2 + lookup 3 |" in out.with_suffix(".md").read_text()
    both = tmp_path / "both"  # first turns, then second turns: groups of one turn each, ours' speedup per turn
    res = run_module("benchmarks.batching", "--target", str(tiny_target_dir), "--draft", str(head_dir),
                     "--total-tokens", "4", "--depth", "2", "--lookup", "3", "--batch-sizes", "2", "--dtypes", "fp32",
                     "--prompts", "2", "--max-new-tokens", "6", "--turn", "both", "--answer-tokens", "5",
                     "--min-groups", "1", "--out", str(both))
    assert res.returncode == 0, res.stderr
    result = json.loads(both.with_suffix(".json").read_text())
    run = result["runs"][0]
    assert result["turn"] == "both" and run["prompt_tokens"] == first_turns + second["prompt_tokens"]
    assert run["batches"]["2"]["group_speedup"]["groups"] == 2
    assert set(run["batches"]["2"]["turn_speedup"]) == {"1", "2"}
    assert "first / second turns" in both.with_suffix(".md").read_text()


def test_pass_cost_study_on_a_tiny_target(tmp_path, tiny_target_dir, head_dir):
    """The pass over n tokens per row as a multiple of the one-token pass, per batch size and dtype."""
    out = tmp_path / "pass-cost"
    res = run_module("benchmarks.pass_cost", "--target", str(tiny_target_dir), "--draft", str(head_dir),
                     "--batch-sizes", "1,2", "--tokens", "1,4", "--dtypes", "fp32", "--repeats", "2", "--out", str(out))
    assert res.returncode == 0, res.stderr
    batches = json.loads(out.with_suffix(".json").read_text())["runs"][0]["batches"]
    assert set(batches) == {"1", "2"} and all(set(r["pass_s"]) == {"1", "4"} for r in batches.values())
    assert all(s > 0 for r in batches.values() for s in [*r["pass_s"].values(), r["draft_level_s"]])
    assert "| 2 | " in out.with_suffix(".md").read_text()


def test_batching_verdict_names_where_speculation_paid_and_where_it_stopped():
    from benchmarks.batching import verdict

    def run(*sizes: tuple[int, int, float]) -> dict:  # (B, tree nodes, speedup)
        return {"batches": {str(b): {"tree": {"total_tokens": n}, "speedup": x} for b, n, x in sizes}}

    assert verdict(run((1, 12, 1.3), (2, 6, 1.2), (4, 0, 1.0))) == (
        "Speculation paid (drafting, above 1.0x) at batch 1, 2; ours drafted nothing at batch 4 (it is then the "
        "plain loop: its ratio to the plain baselines is measurement noise); from batch 4 on it stopped paying.")
    assert verdict(run((1, 12, 1.3), (2, 0, 1.1), (4, 2, 1.05), (8, 1, 0.97))).endswith(
        "from batch 8 on it stopped paying.")  # not "from batch 2": it paid again at 4
    assert verdict(run((1, 4, 1.2), (2, 4, 1.1))).endswith("at batch 1, 2; it paid at every batch size measured.")
    assert verdict(run((1, 4, 1.2), (2, 4, 0.98), (4, 4, 1.02))) == (
        "Speculation paid (drafting, above 1.0x) at batch 1, 4; drafting, it read at most 1.0x at batch 2.")
    assert verdict(run((1, 0, 1.02), (2, 0, 0.9))).startswith("Speculation paid at no batch size; ours drafted")
    adapting = run((1, 0, 1.75), (2, 0, 1.02))  # one prompt without a tuned tree still drafts when it adapts
    adapting["batches"]["1"]["drafts"] = "no tree, adapting per request"
    adapting["batches"]["2"]["drafts"] = "no tree"
    assert verdict(adapting).startswith("Speculation paid (drafting, above 1.0x) at batch 1; ours drafted nothing at "
                                        "batch 2")
    adapting["batches"]["1"]["speedup"] = 0.95  # drafted and lost, with nothing paying: still named
    assert verdict(adapting).startswith("Speculation paid at no batch size; drafting, it read at most 1.0x at batch 1; "
                                        "ours drafted nothing at batch 2")


def test_headline_names_the_tuned_start_of_adaptive_runs():
    from benchmarks.headline import tree_cell

    tuned = {"reason": "the plain loop: no tree beat it"}
    plain = {"tree": {"depth": 0, "total_tokens": 0, "lookup": 10}, "tuning": tuned, "plain_fraction": 0.3}
    assert tree_cell(plain) == "adaptive from the plain loop; trees + lookup 10, 30% plain steps"
    tree = {"tree": {"depth": 1, "total_tokens": 5, "lookup": 0}, "tuning": tuned, "plain_fraction": 0.7}
    assert tree_cell(tree) == "adaptive from 5 nodes, depth 1, 70% plain steps"
    assert tree_cell({**tree, "tuning": None}) == "5 nodes, depth 1"  # a fixed tree (or a run before adaptation)


def test_paired_studies_continue_with_the_reference_answer_and_refuse_other_tokens():
    from types import SimpleNamespace

    from benchmarks.paired import take_turns

    seen = []

    def generate(name: str, ids: torch.Tensor):
        seen.append((name, ids.shape[0]))
        tokens = [7, 8] if name == "bad" else [5, 6]
        stats = SimpleNamespace(new_tokens=2, tau=1.0 if name == "plain" else 2.0)
        result = SimpleNamespace(stats=stats, text=f"answer-{len(seen)}",
                                 sequences=torch.tensor([ids.tolist() + tokens]))
        return (0.5 if name == "plain" else 0.25), result

    def encode(messages: list[dict]) -> torch.Tensor:
        return torch.arange(len(messages))  # one token per message: the second turn sees three

    rows = take_turns(generate, ["plain", "tree"], encode, 1, lambda name, result: {"name": name})
    assert len(rows) == 2 * 8 and [r["turn"] for r in rows[:2]] == [0, 1]  # 8 categories, both turns
    assert seen[:4] == [("plain", 1), ("tree", 1), ("plain", 3), ("tree", 3)]
    assert rows[0]["tree"] == {"tokens_per_s": 8.0, "tau": 2.0, "new_tokens": 2, "name": "tree"}
    with pytest.raises(RuntimeError, match="bad wrote other tokens than plain"):
        take_turns(generate, ["plain", "bad"], encode, 1)


def test_clone_cost_splits_the_history_into_present_and_earlier_versions_by_folder(tmp_path):
    import subprocess

    repo = tmp_path / "repo"
    (repo / "checkpoints" / "head").mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    weights = repo / "checkpoints" / "head" / "model.safetensors"
    for seed in (0, 1):  # two versions of incompressible weights, 600 kB each
        weights.write_bytes(torch.randint(0, 256, (600_000,), generator=torch.Generator().manual_seed(seed),
                                          dtype=torch.uint8).numpy().tobytes())
        (repo / "README.md").write_text(f"version {seed}\n")
        subprocess.run(git + ["add", "-A"], check=True)
        subprocess.run(git + ["commit", "-qm", f"v{seed}"], check=True)
    out = tmp_path / "clone-cost"
    assert run_main("benchmarks.clone_cost", "--repo", str(repo), "--out", str(out))[0] == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["commits"] == 2
    earlier, present = result["history"]["earlier"], result["history"]["present"]
    assert earlier["checkpoints/head"] > 590_000 and present["checkpoints/head"] > 590_000  # one version each
    assert 0 < earlier["README.md"] < 100 and 0 < present["README.md"] < 100
    clones = result["clones"]
    assert clones["full"]["git_bytes"] > clones["depth 1"]["git_bytes"] + 590_000  # only the full clone has both
    assert clones["blobless"]["git_bytes"] < clones["full"]["git_bytes"] - 590_000
    assert all(c["tree_bytes"] == 600_000 + len("version 1\n") for c in clones.values())
    assert "| `checkpoints/head` | 0.6 | 0.6 |" in out.with_suffix(".md").read_text()
    code, err = run_main("benchmarks.clone_cost", "--repo", str(tmp_path), "--out", str(out))
    assert code == 2 and "is not a git checkout" in err
