"""benchmarks.learning_curve: the recipe's learning curve, its log-linear fit and the GRIFFIN/EAGLE ratio."""

from __future__ import annotations

import json
import math

from benchmarks import learning_curve


def point(head: str, chunk: int, tokens: int, regen: float) -> dict:
    return {"head": head, "chunk": chunk, "tokens_seen": tokens, "steps": 1,
            "fixed": {"regen": [{"pass": 1, "top1": regen, "kept": 1.0}]}}


def test_fit_recovers_a_log_linear_curve_and_extrapolates_the_target():
    line = learning_curve.fit([(t, 0.1 + 0.05 * math.log(t)) for t in (2e6, 4e6, 8e6)])
    assert math.isclose(line["a"], 0.1) and math.isclose(line["b"], 0.05)
    assert math.isclose(line["per_doubling"], 0.05 * math.log(2))
    assert math.isclose(learning_curve.tokens_for(line, 0.1 + 0.05 * math.log(16e6)), 16e6)
    assert learning_curve.fit([(1e6, 0.3), (2e6, 0.4)]) is None  # too few points
    assert learning_curve.tokens_for({"a": 0.5, "b": -0.01}, 0.6) is None  # a falling line never gets there


def test_the_curve_is_written_with_the_ratio_at_the_same_chunk_and_bad_input_is_one_line(tmp_path, capsys):
    curve = [point("griffin-s1", c, (c + 1) * 1_000_000, 0.3 + 0.02 * c) for c in range(4)]
    curve += [point("eagle-s1", c, (c + 1) * 1_000_000, 0.25 + 0.02 * c) for c in range(4)]
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"curve": curve}))
    assert learning_curve.main(["--recipe", str(recipe), "--out-dir", str(tmp_path), "--fit-from", "0"]) == 0
    result = json.loads((tmp_path / "learning-curve.json").read_text())
    last = [r for r in result["ratios"] if r["chunk"] == 3]
    assert len(last) == 1 and math.isclose(last[0]["ratio"], 0.36 / 0.31)
    assert result["fits"]["griffin-s1"]["regen"]["points"] == 4 and result["fits"]["griffin-s1"]["regen"]["b"] > 0
    table = (tmp_path / "learning-curve.md").read_text()
    assert "| griffin-s1/eagle-s1 | regen | 3 | 4,000,000 | 1.161x |" in table
    capsys.readouterr()
    assert learning_curve.run_cli(learning_curve.main, argv=["--recipe", str(tmp_path / "none.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_stage2_head_is_fitted_over_its_lineage_and_each_kind_of_chunk_shows_its_change(tmp_path):
    parent = [point("griffin-s1", c, (c + 1) * 1_000_000, 0.3 + 0.02 * c) for c in range(4)]
    forked = [point("griffin", c, (c + 1) * 1_000_000, 0.3 + 0.02 * c + (0.01 if c % 2 else -0.01)) for c in (4, 5)]
    state = {"curve": parent + forked, "heads": {"griffin-s1": {"forked_from": None},
                                                 "griffin": {"forked_from": "griffin-s1"}},
             "timings": [{"chunk": c, "kind": ("sharegpt", "regen")[c % 2]} for c in range(6)]}
    result = learning_curve.curve(state, 0, 0.6)
    line = result["fits"]["griffin"]["regen"]
    assert line["points"] == 6  # the parent's 4 points before the fork, then its own 2
    assert result["fits"]["griffin-s1"]["regen"]["points"] == 4 and len(result["heads"]["griffin"]["regen"]) == 2
    # chunk 4 (ShareGPT) moved griffin from its parent's 0.36 to 0.37, chunk 5 (answers) from 0.37 to 0.41
    assert math.isclose(line["gain_by_kind"]["sharegpt"], (0.02 + 0.01) / 2)
    assert math.isclose(line["gain_by_kind"]["regen"], (0.02 + 0.02 + 0.04) / 3)


def test_two_records_are_drawn_side_by_side_with_the_eagle3_generations_pair(tmp_path):
    shipped = tmp_path / "recipe.json"
    shipped.write_text(json.dumps({"curve": [point("griffin", c, (c + 1) * 1_000_000, 0.4) for c in range(3)]}))
    third = tmp_path / "recipe3.json"
    third.write_text(json.dumps({"curve": [point(h, c, (c + 1) * 1_000_000, top1) for c in range(3)
                                           for h, top1 in (("eagle3", 0.30), ("griffin3", 0.33))]}))
    assert learning_curve.main(["--recipe", str(shipped), str(third), "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "learning-curve.json").read_text())
    assert sorted(result["heads"]) == ["eagle3", "griffin", "griffin3"]
    assert {r["heads"] for r in result["ratios"]} == {"griffin3/eagle3"}
    assert "| griffin3/eagle3 | regen | 2 | 3,000,000 | 1.100x |" in (tmp_path / "learning-curve.md").read_text()
