"""Draft heads: shapes, parameter counts, persistence, official checkpoint layouts, target checks."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from griffin import DraftConfig, DraftModel
from griffin.draft import check_state_dict
from griffin.drafters import HeadDrafter
from griffin.official import EAGLE_KEYS, GRIFFIN_KEYS
from griffin.target import TargetHead
from tests.conftest import tiny_model

SMOL = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)


def expected_params(h: int, i: int, nh: int, nkv: int, d: int, arch: str) -> int:
    fc = 2 * h * h + h
    attn = h * nh * d + 2 * h * nkv * d + nh * d * h
    mlp_out = 2 * h if arch == "griffin" else h
    mlp = 2 * h * i + i * mlp_out
    tgf = (2 * h + 2 * h * i + i * h) if arch == "griffin" else 0  # two norms, up, down
    return fc + attn + h + mlp + tgf


@pytest.mark.parametrize("arch", ["griffin", "eagle"])
def test_shapes_and_parameter_counts(arch):
    cfg = DraftConfig(arch=arch, **SMOL)
    model = DraftModel(cfg)
    assert model.num_parameters() == expected_params(576, 1536, 9, 3, 64, arch)
    assert model.num_parameters() == {"griffin": 7_743_744, "eagle": 4_203_648}[arch]
    target = tiny_model(vocab_size=97, hidden=64)
    head = DraftModel(DraftConfig.from_target(target.config, arch=arch)).attach(target)
    ids, feats = torch.randint(0, 97, (2, 5)), torch.randn(2, 5, 64)
    out = head(ids, feats, torch.arange(5)[None].expand(2, 5))
    assert out.predict.shape == out.regress.shape == (2, 5, 64)
    assert out.key.shape == (2, 2, 5, 16)
    assert head.logits(out.predict).shape == (2, 5, 97)
    assert (arch == "eagle") == torch.equal(out.predict, out.regress)


def test_causal_prefix_consistency():
    """Running positions one by one with past keys gives the same output as running them together."""
    target = tiny_model(vocab_size=50, hidden=64)
    head = DraftModel(DraftConfig.from_target(target.config, arch="griffin")).attach(target).eval()
    ids, feats, pos = torch.randint(0, 50, (1, 6)), torch.randn(1, 6, 64), torch.arange(6)[None]
    full = head(ids, feats, pos)
    first = head(ids[:, :4], feats[:, :4], pos[:, :4])
    rest = head(ids[:, 4:], feats[:, 4:], pos[:, 4:], past_kv=(first.key, first.value))
    torch.testing.assert_close(rest.predict, full.predict[:, 4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["griffin", "eagle"])
def test_save_load_round_trip_is_bit_exact(tmp_path, arch):
    target = tiny_model(vocab_size=64, hidden=64)
    head = DraftModel(DraftConfig.from_target(target.config, arch=arch, draft_vocab_size=40))
    head.draft_vocab.copy_(torch.randperm(64)[:40].sort().values)
    head.save_pretrained(tmp_path)
    loaded = DraftModel.from_pretrained(tmp_path)
    assert loaded.config == head.config
    for (k1, v1), (k2, v2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2), k1
    assert "embed" not in json.dumps(list(loaded.state_dict()))  # the target's embedding is not stored
    head.attach(target), loaded.attach(target)
    ids, feats, pos = torch.randint(0, 64, (1, 7)), torch.randn(1, 7, 64), torch.arange(7)[None]
    assert torch.equal(head.logits(head(ids, feats, pos).predict), loaded.logits(loaded(ids, feats, pos).predict))


def test_fp16_checkpoint_loads_as_fp32(tmp_path):
    head = DraftModel(DraftConfig(arch="griffin", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=30))
    head.save_pretrained(tmp_path, dtype=torch.float16)
    loaded = DraftModel.from_pretrained(tmp_path)
    assert loaded.fusion.fc.weight.dtype == torch.float32
    assert torch.equal(loaded.fusion.fc.weight, head.fusion.fc.weight.half().float())


def test_attach_to_another_target_raises():
    head = DraftModel(DraftConfig.from_target(tiny_model(vocab_size=64, hidden=64).config))
    with pytest.raises(ValueError, match="vocabulary 64.*vocabulary 80"):
        head.attach(tiny_model(vocab_size=80, hidden=64))
    with pytest.raises(ValueError, match="hidden size 64"):
        head.attach(tiny_model(vocab_size=64, hidden=32))


# --- official layouts --------------------------------------------------------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures"  # outputs of the official code: see fixtures/PROVENANCE.md


@pytest.mark.parametrize("arch,fmt", [("griffin", "safetensors"), ("griffin", "bin"), ("eagle", "safetensors"),
                                      ("eagle", "bin")])
def test_official_checkpoints_reproduce_the_official_code(tmp_path, arch, fmt):
    """Our loader, head and tree drafting against what the official GRIFFIN / EAGLE code computed on the same
    checkpoint: the head's features at every context position and the whole drafted tree."""
    src = FIXTURES / f"official-{arch}"
    folder = src
    if fmt == "bin":
        folder = tmp_path
        shutil.copyfile(src / "config.json", folder / "config.json")
        torch.save(load_file(str(src / "model.safetensors")), folder / "pytorch_model.bin")
    io = load_file(str(src / "io.safetensors"))
    with safe_open(str(src / "io.safetensors"), "pt") as handle:
        official = {k: int(v) for k, v in handle.metadata().items()}
    head = DraftModel.from_pretrained(folder)
    assert head.config.arch == arch
    raw = json.loads((src / "config.json").read_text())
    target = TargetHead(LlamaConfig(**{k: raw[k] for k in ("hidden_size", "vocab_size", "intermediate_size",
                                                             "num_attention_heads", "num_key_value_heads")}),
                        load_file(str(src / "model.safetensors"))["embed_tokens.weight"], io["lm_head"])
    head.attach(target)
    ids, hidden = io["input_ids"], io["hidden"]
    context = hidden.shape[1]
    out = head(ids[:, 1:], hidden, torch.arange(context)[None])
    torch.testing.assert_close(out.predict, io["predict"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.regress, io["regress"], rtol=1e-5, atol=1e-5)
    drafter = HeadDrafter(head, depth=official["depth"] + 1, top_k=official["top_k"],
                          total_tokens=official["total_tokens"] - 1, capacity=64)
    drafter.start(ids[0, :-1], hidden[0], ids[0, -1:])
    tree = drafter.propose(ids[0, -1:])
    assert tree.tokens.tolist() == io["draft_tokens"][0].tolist()
    assert tree.depths.tolist() == io["tree_position_ids"].tolist()
    assert torch.equal(tree.ancestors, io["tree_mask"][0, 0].bool())
    assert tree.depths.max() >= 3  # deep enough that every drafting position matters


def test_official_layout_errors_name_the_keys(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "intermediate_size": 16, "vocab_size": 10,
                                                      "num_attention_heads": 2, "num_key_value_heads": 2}))
    state = {"fc.weight": torch.zeros(8, 16), "fc.bias": torch.zeros(8), "layers.0.bogus.weight": torch.zeros(2)}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.0.bogus.weight"):
        DraftModel.from_pretrained(tmp_path)
    del state["layers.0.bogus.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing keys.*layer.self_attn.q_proj.weight"):
        DraftModel.from_pretrained(tmp_path)
    model = DraftModel(DraftConfig(hidden_size=8, intermediate_size=16, vocab_size=10, num_attention_heads=2,
                                   num_key_value_heads=2, arch="eagle"))
    state = dict(model.state_dict())
    state["fusion.fc.weight"] = torch.zeros(8, 17)
    with pytest.raises(ValueError, match=r"shape mismatches.*fusion.fc.weight: checkpoint \(8, 17\)"):
        check_state_dict(model, state, "x")


@pytest.mark.parametrize("arch", ["griffin", "eagle"])
def test_official_export_round_trips_through_the_official_loader(tmp_path, arch):
    from safetensors.torch import load_file

    from training import export

    target = tiny_model(vocab_size=64, hidden=64)
    target.save_pretrained(tmp_path / "target")
    torch.manual_seed(3)
    head = DraftModel(DraftConfig.from_target(target.config, arch=arch, draft_vocab_size=40))
    head.draft_vocab.copy_(torch.randperm(64)[:40].sort().values)
    with torch.no_grad():  # norms away from 1, so that a swapped norm would show
        for p in head.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    head.save_pretrained(tmp_path / "head")
    run = {"arch": arch, "steps": 1, "topk": 3, "lr": 1e-3, "total_updates": 1, "global_batch": 1, "features": "f",
           "mixed_precision": "no", "train_conversations": 1, "val_conversations": 1, "noise": 0.2, "init_from": None}
    passes = [{"pass": 1, "loss": 1.0, "top1": 0.5, "top3": 0.7, "kept": 1.0, "positions": 10}]
    (tmp_path / "head" / "validation.json").write_text(json.dumps({"run": run, "epochs": [
        {"epoch": 0, "updates": 1, "tokens": 10, "train_seconds": 1.0, "passes": passes}]}))
    ids, feats, pos = torch.randint(0, 64, (1, 7)), torch.randn(1, 7, 64), torch.arange(7)[None]
    for dtype in ("fp32", "fp16"):
        dst = tmp_path / f"official-{dtype}"
        assert export.main([str(tmp_path / "head"), str(dst), "--format", "official", "--target",
                            str(tmp_path / "target"), "--dtype", dtype, "--results", str(tmp_path)]) == 0
        config = json.loads((dst / "config.json").read_text())
        assert "arch" not in config and config["num_hidden_layers"] == 1 and config["bias"] is True
        state = load_file(str(dst / "model.safetensors"))
        keys = GRIFFIN_KEYS if arch == "griffin" else EAGLE_KEYS
        assert set(state) == set(keys) - {k for k in keys if k.endswith(".bias") and "self_attn" in k} | {
            "embed_tokens.weight"}
        assert torch.equal(state["embed_tokens.weight"].float(),
                           target.get_input_embeddings().weight.to(state["embed_tokens.weight"].dtype).float())
        loaded = DraftModel.from_pretrained(dst).attach(target)
        assert loaded.config.arch == arch and loaded.config.draft_vocab_size == 0  # expanded to the full vocabulary
        want = copy.deepcopy(head)
        if dtype == "fp16":
            want = want.half().float()
        want.attach(target)
        got, ref = loaded(ids, feats, pos), want(ids, feats, pos)
        torch.testing.assert_close(got.predict, ref.predict, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.regress, ref.regress, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loaded.logits(got.predict)[..., head.draft_vocab], want.logits(ref.predict))
        card = (dst / "README.md").read_text()
        assert "official" in card and "expanded to the target's full lm_head (64 tokens)" in card
