"""GRIFFIN's two draft-model parts taken out one at a time (``tgf``, ``dual_heads``): the ablation heads that say which
part pays, on the GRIFFIN base and on the EAGLE-3 base; their config, forward, persistence, training and export."""

from __future__ import annotations

import json

import pytest
import torch

from griffin.config import DraftConfig
from griffin.draft import DraftModel
from griffin.official import official_state
from tests.conftest import run_main, tiny_model
from tests.test_features import conversations, write_data
from training.export import layout_text

ARCHS = ["griffin", "griffin3"]


def head(target, arch: str, **parts) -> DraftModel:
    torch.manual_seed(0)
    return DraftModel(DraftConfig.from_target(target.config, arch=arch, **parts)).attach(target)


def features(target, arch: str, t: int) -> torch.Tensor:
    width = 3 * target.config.hidden_size if arch == "griffin3" else target.config.hidden_size
    return torch.randn(1, t, width, generator=torch.Generator().manual_seed(1))


def test_parts_default_to_the_arch_and_are_checked():
    target = tiny_model(layers=6)
    for arch, on in (("griffin", True), ("griffin3", True), ("eagle", False), ("eagle3", False)):
        cfg = DraftConfig.from_target(target.config, arch=arch)
        assert (cfg.tgf, cfg.dual_heads, cfg.parts_ablated) == (on, on, [])
    cfg = DraftConfig.from_target(target.config, arch="griffin3", tgf=False)
    assert cfg.parts_ablated == ["Token-Guided Fusion"] and cfg.tgf_intermediate_size is None
    assert DraftConfig.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in DraftConfig.from_target(target.config, arch="griffin").to_dict().items()
           if k not in ("tgf", "dual_heads")}  # a config.json written before the parts were fields
    assert (DraftConfig.from_dict(old).tgf, DraftConfig.from_dict(old).dual_heads) == (True, True)
    with pytest.raises(ValueError, match="'tgf' is a part of the griffin archs, not of 'eagle3': use arch=griffin3"):
        DraftConfig.from_target(target.config, arch="eagle3", tgf=True)
    with pytest.raises(ValueError, match="without Token-Guided Fusion and dual heads is an eagle head"):
        DraftConfig.from_target(target.config, arch="griffin", tgf=False, dual_heads=False)
    with pytest.raises(ValueError, match="'dual_heads' must be true, false or null"):
        DraftConfig.from_target(target.config, arch="griffin", dual_heads="no")


@pytest.mark.parametrize("arch", ARCHS)
def test_each_part_comes_out_alone(arch):
    """Without TGF the fusion is the arch's plain fc and the dual heads stay; without dual heads the MLP writes one
    feature, scored (normed, on the EAGLE-3 base) and fed back, and TGF stays. Each ablation has fewer parameters
    than the full head, and a full head's forward is unchanged by the new fields."""
    target = tiny_model(layers=6)
    full, no_tgf, no_dual = head(target, arch), head(target, arch, tgf=False), head(target, arch, dual_heads=False)
    ids, f, pos = torch.randint(0, 128, (1, 5)), features(target, arch, 5), torch.arange(5)[None]
    tgf_of = (lambda h: h.fusion.tgf) if arch == "griffin3" else (lambda h: getattr(h.fusion, "up", None))
    assert tgf_of(full) is not None and tgf_of(no_tgf) is None and tgf_of(no_dual) is not None
    h = target.config.hidden_size
    assert full.layer.mlp.down_proj.out_features == no_tgf.layer.mlp.down_proj.out_features == 2 * h
    assert no_dual.layer.mlp.down_proj.out_features == h
    scored = (lambda m, out: m.norm(out.regress)) if arch == "griffin3" else (lambda m, out: out.regress)
    for model, dual in ((full, True), (no_tgf, True), (no_dual, False)):
        out = model(ids, f, pos)
        assert out.predict.shape == out.regress.shape == (1, 5, h)
        assert torch.equal(out.predict, scored(model, out)) != dual
        assert model.logits(out.predict).shape[-1] == model.config.output_vocab_size
    assert full.num_parameters() > max(no_tgf.num_parameters(), no_dual.num_parameters())
    reference = DraftModel(DraftConfig.from_target(target.config, arch=arch, tgf=None, dual_heads=None))
    reference.load_state_dict(full.state_dict())
    torch.testing.assert_close(reference.attach(target)(ids, f, pos).predict, full(ids, f, pos).predict)


def test_an_ablation_head_round_trips_and_says_what_it_lacks(tmp_path):
    target = tiny_model(layers=6)
    for arch in ARCHS:
        model = head(target, arch, dual_heads=False)
        model.save_pretrained(tmp_path / arch)
        again = DraftModel.from_pretrained(tmp_path / arch).attach(target)
        assert (again.config.tgf, again.config.dual_heads) == (True, False)
        ids, f, pos = torch.randint(0, 128, (1, 4)), features(target, arch, 4), torch.arange(4)[None]
        torch.testing.assert_close(again(ids, f, pos).regress, model(ids, f, pos).regress)
        assert "an ablation head, built without dual heads" in layout_text(again, "griffin", "fp32")[0]
    assert "cannot run its Token-Guided Fusion, so it" in layout_text(again, "griffin", "fp32")[0]
    with pytest.raises(ValueError, match="built without Token-Guided Fusion, which the official GRIFFIN layout"):
        official_state(head(target, "griffin", tgf=False), target.get_input_embeddings().weight)


def test_train_builds_resumes_and_refuses_ablation_heads(tmp_path, tiny_target_dir):
    data = write_data(tmp_path / "data.json", conversations(8))
    store = tmp_path / "layered"
    common = ["--target", str(tiny_target_dir), "--data", data, "--max-len", "128"]
    assert run_main("training.build_features", "--out", str(store), "--feature-layers", "auto", *common)[0] == 0
    train = ["--features", str(store), "--batch-size", "2", "--ttt-steps", "2", "--topk", "0", "--arch", "griffin3"]
    out = tmp_path / "no-tgf"
    code, err = run_main("training.train", *train, "--no-tgf", "--out", str(out), "--max-updates", "2",
                         "--save-every", "1")
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert (config["tgf"], config["dual_heads"]) == (False, True)
    run = json.loads((out / "validation.json").read_text())["run"]
    assert (run["tgf"], run["dual_heads"]) == (False, True)
    code, err = run_main("training.train", *train, "--out", str(out), "--max-updates", "2", "--resume")
    assert code == 2 and "no_tgf: True then, False now" in err
    # a run saved before the flags existed resumes as the full head it was
    full = tmp_path / "full"
    assert run_main("training.train", *train, "--out", str(full), "--max-updates", "1", "--save-every", "1")[0] == 0
    progress = full / "train_state" / "progress.json"
    saved = json.loads(progress.read_text())
    saved["settings"] = {k: v for k, v in saved["settings"].items() if k not in ("no_tgf", "no_dual_heads")}
    progress.write_text(json.dumps(saved))
    (full / "validation.json").unlink()
    code, err = run_main("training.train", *train, "--out", str(full), "--max-updates", "1", "--resume")
    assert code == 0, err
    assert json.loads((full / "validation.json").read_text())["run"]["tgf"] is True
    code, err = run_main("training.train", *train, "--init-from", str(out), "--out", str(tmp_path / "x"))
    assert code == 2 and "is built without Token-Guided Fusion: pass the --no-tgf / --no-dual-heads" in err
    for flags, message in ((["--arch", "eagle3", "--no-tgf"], "--arch eagle3 has neither"),
                           (["--no-tgf", "--no-dual-heads"], "is an eagle3 head: pass --arch eagle3")):
        code, err = run_main("training.train", *train, *flags, "--out", str(tmp_path / "y"))
        assert code == 2 and err.strip().endswith(message)
    assert not (tmp_path / "y").exists()  # refused before any folder is made


def test_train_widens_the_draft_layer_alone_to_match_a_larger_head(tmp_path, tiny_target_dir):
    """``--intermediate-size``: an eagle3 head as large as a griffin3 one (the control that tells Token-Guided
    Fusion's guidance from its width). The decoder layer's MLP widens, TGF keeps the target's width, and a resume or
    an --init-from of another width is refused."""
    data = write_data(tmp_path / "data.json", conversations(8))
    store = tmp_path / "layered"
    common = ["--target", str(tiny_target_dir), "--data", data, "--max-len", "128"]
    assert run_main("training.build_features", "--out", str(store), "--feature-layers", "auto", *common)[0] == 0
    train = ["--features", str(store), "--batch-size", "2", "--ttt-steps", "2", "--topk", "0", "--max-updates", "1",
             "--save-every", "1"]
    target_width = json.loads((tiny_target_dir / "config.json").read_text())["intermediate_size"]
    sizes = {}
    for arch in ("eagle3", "griffin3"):
        out = tmp_path / arch
        code, err = run_main("training.train", *train, "--arch", arch, "--intermediate-size", "96", "--out", str(out))
        assert code == 0, err
        model = DraftModel.from_pretrained(out)
        assert model.layer.mlp.up_proj.out_features == model.config.intermediate_size == 96 != target_width
        assert json.loads((out / "validation.json").read_text())["run"]["intermediate_size"] == 96
        sizes[arch] = model.num_parameters()
        if arch == "griffin3":
            assert model.fusion.tgf.up.out_features == model.config.tgf_intermediate_size == target_width
    narrow = tmp_path / "narrow"
    assert run_main("training.train", *train, "--arch", "eagle3", "--out", str(narrow))[0] == 0
    assert DraftModel.from_pretrained(narrow).num_parameters() < sizes["eagle3"] < sizes["griffin3"]
    (tmp_path / "eagle3" / "validation.json").unlink()
    code, err = run_main("training.train", *train, "--arch", "eagle3", "--out", str(tmp_path / "eagle3"), "--resume")
    assert code == 2 and "intermediate_size: 96 then, None now" in err
    code, err = run_main("training.train", *train, "--arch", "eagle3", "--init-from", str(narrow),
                         "--intermediate-size", "96", "--out", str(tmp_path / "x"))
    assert code == 2 and "has an MLP width of" in err and "--intermediate-size is 96" in err
