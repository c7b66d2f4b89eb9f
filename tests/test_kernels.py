"""Weight-major linear layers for small verification passes: same values as F.linear, scoped, restored on exit; the
kernel choice measured per machine and cached."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from griffin import kernels
from griffin.kernels import ONE_ROW_KERNELS, KernelChoice, WeightMajorLinears, choose_kernels, pick
from griffin.plain import plain_generate
from griffin.sampling import SamplingConfig
from tests.conftest import tiny_model


class Quantized(nn.Linear):
    """Stands for a linear subclass with its own kernel, which must be left alone."""


def test_small_inputs_are_computed_weight_major_and_others_by_f_linear(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.Linear(96, 32, bias=False), Quantized(32, 8)).eval()
    calls = []
    real_linear = F.linear

    def counting_linear(*args, **kwargs):
        calls.append(args[0].shape)
        return real_linear(*args, **kwargs)

    with torch.inference_mode():
        for rows in (1, 2, 3, 8, 9, 20):
            x = torch.randn(1, rows, 48)
            expected = model(x)
            calls.clear()
            with monkeypatch.context() as patch:
                patch.setattr(F, "linear", counting_linear)
                with WeightMajorLinears(model, max_rows=8):
                    got = model(x)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            switched = 2 <= rows <= 8
            assert len(calls) == (1 if switched else 3), rows  # only the subclass keeps F.linear when switched
            if not switched:
                assert torch.equal(got, expected)
    assert all("forward" not in vars(m) for m in model)  # the modules' own forward is back
    assert not any(name in vars(m) for m in model for name in kernels._SWITCHED)  # and nothing else is left


def test_a_whole_model_gives_the_same_logits_and_nothing_is_switched_when_off():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 5))
    with torch.inference_mode():
        expected = model(ids).logits
        with WeightMajorLinears(model, max_rows=8) as switched:
            assert len(switched.linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer and the LM head
            torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
        assert WeightMajorLinears(model, max_rows=0).linears == []
        hooked = model.lm_head
        hooked.forward = hooked.forward  # an instance-level forward, as accelerate's hooks install
        assert hooked not in WeightMajorLinears(model, max_rows=8).linears
    too_small = KernelChoice("pad", kernels.DEFAULT_MAX_ROWS, "weight-major", "default")
    assert choose_kernels(model) == too_small  # too small to time
    assert choose_kernels(tiny_model("llama").to("meta")).max_rows == 0  # nothing to switch


@pytest.mark.parametrize("kernel", ONE_ROW_KERNELS)
def test_one_row_kernels_give_the_values_of_f_linear(kernel, monkeypatch):
    torch.manual_seed(0)
    layer = nn.Linear(48, 96).eval()
    calls = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **k: calls.append(1) or real_linear(*a, **k))
    with torch.inference_mode():
        x = torch.randn(1, 1, 48)
        expected = real_linear(x, layer.weight, layer.bias)
        with WeightMajorLinears(layer, max_rows=0, one_row=kernel) as switched:
            got = layer(x)
            two_rows = layer(torch.randn(1, 2, 48))  # max_rows=0: more than one row keeps F.linear
    assert switched.linears == ([] if kernel == "linear" else [layer])  # nothing to switch for F.linear alone
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert len(calls) == (2 if kernel == "linear" else 1) and two_rows.shape == (1, 2, 96)
    with pytest.raises(ValueError, match="one_row"):
        WeightMajorLinears(layer, 8, one_row="fast")


@pytest.mark.parametrize("kernel", ONE_ROW_KERNELS)
def test_plain_loop_with_each_one_row_kernel_equals_generate(kernel):
    model = tiny_model("llama", vocab_size=128, seed=3)
    ids = torch.randint(0, 128, (7,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = model.generate(ids[None], max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 7:]
    got = plain_generate(model, ids, 12, SamplingConfig(0.0), torch.tensor([], dtype=torch.long), one_row=kernel)
    assert got.tolist() == expected.tolist()
    assert all("forward" not in vars(m) for m in model.modules())


def test_one_token_target_forwards_take_plain_decodings_kernel(monkeypatch):
    """The cost model's plain step (a one-token backend forward) uses the kernel plain decoding uses, not F.linear."""
    from griffin.backend import TargetBackend
    from griffin.kv_cache import BufferCache

    model = tiny_model("llama", vocab_size=128, seed=3)
    backend = TargetBackend(model)
    assert backend.weight_major.one_row == backend.kernels.one_row == "pad"  # a tiny model: the unmeasured default
    calls = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **k: calls.append(a[0].shape) or real_linear(*a, **k))
    cache = BufferCache(model.config.num_hidden_layers, 16)
    with torch.inference_mode():
        backend.prefill(torch.arange(5), cache)
        calls.clear()
        _, logits = backend.forward(torch.tensor([7]), torch.tensor([5]), torch.ones(1, 1, dtype=torch.bool), cache)
        assert calls == []  # every linear layer of the one-token pass went through the two-row weight-major product
        expected = model(torch.cat([torch.arange(5), torch.tensor([7])])[None]).logits[0, -1:]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert TargetBackend(model, weight_major_rows=0).weight_major.one_row == "pad"  # one token even with rows off


def test_pick_takes_the_fastest_kernel_for_one_row_and_for_each_row_count():
    rows = {"2": {"linear": 2.0, "weight-major": 1.0, "onednn": 1.5}, "3": {"linear": 2.0, "weight-major": 1.5,
            "onednn": 1.0}, "4": {"linear": 2.0, "weight-major": 2.5, "onednn": 1.9},
            "6": {"linear": 3.0, "weight-major": 1.0, "onednn": 3.5}}
    one_row = {"linear": 1.0, "weight-major": 0.9, "pad": 1.1, "onednn": 0.95}
    # 5 rows: interpolated, weight-major 1.75 against onednn 2.7 and linear 2.5
    assert pick({"one_row_s": one_row, "rows": rows}) == (
        "weight-major", 6, ("weight-major", "onednn", "onednn", "weight-major", "weight-major"))
    rows["6"] = {"linear": 1.0, "weight-major": 2.0, "onednn": 3.0}  # F.linear wins from 5 rows: not switched
    assert pick({"one_row_s": one_row, "rows": rows})[1:] == (4, ("weight-major", "onednn", "onednn"))
    rows["3"]["onednn"] = rows["4"]["onednn"] = 2.6  # weight-major at 2 and 3 rows, F.linear from 4: one name
    assert pick({"one_row_s": one_row, "rows": rows})[1:] == (3, "weight-major")
    rows["2"] = {"linear": 2.0, "weight-major": 2.0, "onednn": 2.1}  # a tie goes to F.linear
    rows["3"] = rows["4"] = {"linear": 1.0, "weight-major": 2.0, "onednn": 3.0}
    assert pick({"one_row_s": {"linear": 1.0, "weight-major": 1.2, "pad": 1.1}, "rows": rows})[:2] == ("linear", 0)


def test_a_kernel_per_row_count_switches_each_size_and_names_itself():
    torch.manual_seed(0)
    layer = nn.Linear(48, 96).eval()
    used = []
    real = torch.Tensor.__matmul__
    with torch.inference_mode():
        x = torch.randn(1, 6, 48)
        switch = WeightMajorLinears(layer, max_rows=5, rows_kernel=("weight-major", "linear", "weight-major"))
        assert switch.by_rows == ("weight-major", "linear", "weight-major", "weight-major")  # last entry repeats
        assert switch.describe() == "one row linear; 2 rows weight-major, 4-5 rows weight-major"
        with switch:
            for n in (2, 3, 4, 5, 6):
                calls = []
                torch.Tensor.__matmul__ = lambda a, b, calls=calls: calls.append(1) or real(a, b)
                try:
                    torch.testing.assert_close(layer(x[:, :n]), F.linear(x[:, :n], layer.weight, layer.bias))
                finally:
                    torch.Tensor.__matmul__ = real
                used.append(bool(calls))
    assert used == [True, False, True, True, False]  # weight-major at 2, 4 and 5 rows; F.linear at 3 and past 5
    with pytest.raises(ValueError, match="rows_kernel"):
        WeightMajorLinears(layer, 8, rows_kernel=("weight-major", "pad"))


@pytest.mark.skipif(not kernels.ONEDNN, reason="this torch has no oneDNN")
def test_onednn_kernel_gives_the_values_of_f_linear_and_repacks_changed_weights():
    torch.manual_seed(0)
    layer = nn.Linear(48, 96).eval()
    with torch.inference_mode():
        x = torch.randn(1, 5, 48)
        expected = F.linear(x, layer.weight, layer.bias)
        with WeightMajorLinears(layer, max_rows=8, one_row="onednn", rows_kernel="onednn"):
            torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(layer(x[:, :1]), expected[:, :1], rtol=1e-5, atol=1e-5)
        first = kernels.packed_weight(layer)
        assert kernels.packed_weight(layer) is first  # packed once
        layer.weight.mul_(2)  # an in-place change: packed again
        with WeightMajorLinears(layer, max_rows=8, rows_kernel="onednn"):
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert kernels.packed_weight(layer) is not first and "packed" not in vars(layer)
    with pytest.raises(ValueError, match="rows_kernel"):
        WeightMajorLinears(layer, 8, rows_kernel="pad")


def test_kernels_are_measured_once_per_machine_and_model_then_read_from_the_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "MEASURE_MIN_BYTES", 0)  # time even a tiny model
    monkeypatch.setattr(kernels, "BUDGET_S", 0.0)  # the minimum rounds
    monkeypatch.setattr(kernels, "_CHOICES", {})
    model = tiny_model("llama")
    first = choose_kernels(model)
    assert first.source == "measured" and first.one_row in ONE_ROW_KERNELS
    assert 0 <= first.max_rows <= max(kernels.ROW_SIZES)
    [record] = (tmp_path / "kernels").glob("*.json")
    saved = json.loads(record.read_text())
    as_saved = saved["rows_kernel"] if isinstance(saved["rows_kernel"], str) else tuple(saved["rows_kernel"])
    assert (saved["one_row"], saved["max_rows"], as_saved) == pick(saved) == (
        first.one_row, first.max_rows, first.rows_kernel)
    assert saved["rounds"] >= 3 and set(saved["one_row_s"]) == set(ONE_ROW_KERNELS)
    assert all(set(saved["rows"][str(n)]) == {"linear", *kernels.ROWS_KERNELS} for n in kernels.ROW_SIZES)
    assert all(t > 0 for n in kernels.ROW_SIZES for t in saved["rows"][str(n)].values())
    monkeypatch.setattr(kernels, "_CHOICES", {})  # a new process: the file answers
    cached = KernelChoice(first.one_row, first.max_rows, first.rows_kernel, "cached")
    assert choose_kernels(model) == cached
    assert choose_kernels(model) == cached  # now from memory
    monkeypatch.setattr(kernels, "_CHOICES", {})
    record.write_text("{broken")
    with caplog.at_level(logging.WARNING, logger="griffin.kernels"):
        assert choose_kernels(model).source == "measured"
    assert "damaged" in caplog.text and json.loads(record.read_text())["rounds"] >= 3  # rewritten whole
    assert choose_kernels(model.to(torch.bfloat16)).source == "measured"  # another dtype: another record
    assert len(list((tmp_path / "kernels").glob("*.json"))) == 2
