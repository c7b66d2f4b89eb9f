"""The distillation-objectives report: heads' validation and τ runs -> table, JSON and plot, with paired differences."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks import distill_heads


def write_head(folder, token_loss: str, top1: float, select=None) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    run = {"token_loss": token_loss, "select": select, "select_frac": 0.4 if select else None, "jsd_beta": None,
           "total_updates": 12, "lr": 6e-4, "init_from": "init", "features": "store"}
    passes = [{"pass": k, "top1": top1 - 0.01 * k, "top3": 0.5, "kept": 1.0, "loss": 1.0} for k in (1, 2, 3)]
    epochs = [{"tokens": 4000, "train_seconds": 60.0, "passes": passes}]
    (folder / "validation.json").write_text(json.dumps({"run": run, "epochs": epochs}))


def write_tau(path, name: str, taus: list[float]) -> None:
    per_prompt = [{"question_id": i // 2, "turn": i % 2, "tau": t, "new_tokens": 100 * t, "cycles": 100}
                  for i, t in enumerate(taus)]  # equal cycles: pooled τ is the mean of per-prompt τ
    record = {"head": name, "tau": statistics.fmean(taus), "tau_se": statistics.stdev(taus) / len(taus) ** 0.5,
              "n_prompts": len(taus), "alpha": [0.6, 0.5, 0.4, 0.3, 0.2], "per_prompt": per_prompt,
              "command": "python -m benchmarks.distill_heads --evaluate"}
    path.write_text(json.dumps(record))


def test_report_pairs_each_head_with_soft_ce_on_the_same_prompts(tmp_path):
    heads, results = tmp_path / "heads", tmp_path / "results"
    results.mkdir()
    write_head(tmp_path / "init", "soft-ce", 0.40)
    write_head(heads / "soft-ce", "soft-ce", 0.42)
    write_head(heads / "fkl-adaspec", "fkl", 0.45, select="adaspec")
    base = [2.0, 2.2, 1.8, 2.4]
    better = [2.3, 2.4, 2.0, 2.9]  # per-prompt differences 0.3, 0.2, 0.2, 0.5
    for t in (0, 1):
        write_tau(results / f"mt_bench-init-T{t}.json", "init", [1.9, 2.0, 1.7, 2.2])
        write_tau(results / f"mt_bench-soft-ce-T{t}.json", "soft-ce", base)
        write_tau(results / f"mt_bench-fkl-adaspec-T{t}.json", "fkl-adaspec", better)
    report = tmp_path / "distill-heads.md"
    assert distill_heads.main(["--heads", str(heads), "--init", str(tmp_path / "init"), "--results", str(results),
                               "--report", str(report), "--objectives", "soft-ce,fkl-adaspec"]) == 0
    text = report.read_text()
    diffs = [b - a for a, b in zip(base, better)]
    ratio = statistics.fmean(better) / statistics.fmean(base)
    se = statistics.stdev(diffs) / 2
    want = f"{ratio:.3f}x ({statistics.fmean(diffs):+.3f} ± {se:.3f})"
    assert f"| fkl-adaspec | fkl + AdaSPEC 0.4 | 0.440 / 0.430 / 0.420 | {statistics.fmean(better):.3f}" in text
    assert text.count(want) == 2  # T=0 and T=1
    assert "| init (no fine-tuning) | - |" in text and "0.600 | 0.500 | 0.400 | 0.300 | 0.200 |" in text
    data = json.loads(report.with_suffix(".json").read_text())
    assert data["heads"]["fkl-adaspec"]["tau"]["0"]["vs_baseline"]["paired_se"] == pytest.approx(se)
    assert report.with_suffix(".png").stat().st_size > 1000
