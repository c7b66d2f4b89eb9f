"""python -m training.distill on a tiny target: every data source, a loadable student, learning, exact resume,
AdaSPEC and the TVD++ recipe, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from griffin import SpecGenerator
from tests.conftest import run_main
from training import distill

TOPICS = ["cats", "the sea", "bread", "trains", "rain", "music", "chess", "tea", "snow", "bees", "maps", "clocks"]


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    records = [{"id": str(i), "conversations": [
        {"from": "human", "value": f"Tell me one fact about {topic}."},
        {"from": "gpt", "value": f"Here is a fact about {topic}: people have written about {topic} for centuries."}]}
        for i, topic in enumerate(TOPICS)]
    path = tmp_path_factory.mktemp("chat") / "chat.json"
    path.write_text(json.dumps(records))
    return path


def args(target_dir, chat_file, out, *extra: str) -> list[str]:
    return ["--target", str(target_dir), "--data", str(chat_file), "--out", str(out), "--layers", "1",
            "--draft-vocab", "0", "--batch-size", "2", "--gen-len", "6", "--max-samples", "12", "--val-samples", "2",
            "--warmup", "1", "--save-every", "2", *extra]


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def fkl_student(tiny_target_dir, chat_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("fkl")
    assert distill.main(args(tiny_target_dir, chat_file, out, "--steps", "6", "--lr", "3e-3", "--lambda-fixed",
                             "0.4", "--lambda-student", "0.5", "--val-every", "3")) == 0
    return out


def test_a_mixed_run_uses_every_source_learns_and_saves_a_student_the_generator_loads(fkl_student, tiny_target_dir):
    report = json.loads((fkl_student / distill.REPORT).read_text())
    assert report["progress"]["sources"] == {"fixed": 1, "student": 3, "target": 2}  # seeded draws
    before, after = report["validation"][0]["acceptance"], report["validation"][-1]["acceptance"]
    assert 1 - after < 0.8 * (1 - before), (before, after)  # the TVD to the target fell by over a fifth
    assert [v["updates"] for v in report["validation"]] == [0, 3, 6]  # --val-every 3: a learning curve
    assert all(0 < h["target_nll"] < 20 for h in report["history"])  # the target's NLL of each batch's responses
    assert report["run"]["draft_vocab_size"] is None and report["run"]["student_layers"] == 1
    assert not (fkl_student / "draft_vocab.json").exists()
    gen = SpecGenerator.from_pretrained(str(tiny_target_dir), draft_model=fkl_student, gamma=3)
    prompt = gen.encode([{"role": "user", "content": "Tell me one fact about owls."}])
    ref = gen.target.generate(prompt[None], max_new_tokens=12, do_sample=False)
    assert torch.equal(gen.generate(prompt, max_new_tokens=12).sequences, ref)


def test_an_interrupted_run_resumes_to_the_same_weights(tiny_target_dir, chat_file, tmp_path, monkeypatch):
    common = ("--steps", "4", "--lr", "3e-3", "--lambda-fixed", "0.5", "--lambda-student", "1")
    assert distill.main(args(tiny_target_dir, chat_file, tmp_path / "ref", *common)) == 0
    step = distill.Distiller.step

    def interrupted(self, update):
        if update == 3:
            raise KeyboardInterrupt
        return step(self, update)

    monkeypatch.setattr(distill.Distiller, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill.main(args(tiny_target_dir, chat_file, tmp_path / "run", *common))
    monkeypatch.setattr(distill.Distiller, "step", step)
    assert not (tmp_path / "run" / "config.json").exists()
    code, err = run_main("training.distill", *args(tiny_target_dir, chat_file, tmp_path / "run", *common))
    assert code == 2 and "--resume" in err
    assert distill.main(args(tiny_target_dir, chat_file, tmp_path / "run", *common, "--resume")) == 0
    a, b = weights(tmp_path / "ref"), weights(tmp_path / "run")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    history = json.loads((tmp_path / "run" / distill.REPORT).read_text())["history"]
    assert [h["update"] for h in history] == [1, 2, 3, 4]


def test_adaspec_and_the_tvdpp_recipe(fkl_student, tiny_target_dir, chat_file, tmp_path, monkeypatch):
    kept = []
    select = distill.adaspec_select

    def spy(delta, mask, frac):
        chosen = select(delta, mask, frac)
        kept.append((int(chosen.sum()), int(mask.sum())))
        return chosen

    monkeypatch.setattr(distill, "adaspec_select", spy)
    assert distill.main(args(tiny_target_dir, chat_file, tmp_path / "ada", "--steps", "2", "--select", "adaspec",
                             "--reference", str(fkl_student), "--select-frac", "0.4")) == 0
    assert kept and all(k == -(-4 * n // 10) for k, n in kept)  # ceil(0.4 n) of the response tokens
    assert distill.main(args(tiny_target_dir, chat_file, tmp_path / "tvdpp", "--steps", "2", "--recipe", "tvdpp",
                             "--draft-vocab", "300")) == 0
    run = json.loads((tmp_path / "tvdpp" / distill.REPORT).read_text())
    assert run["run"]["token_loss"] == "tvdpp" and run["progress"]["sources"] == {"fixed": 0, "student": 0,
                                                                                   "target": 2}
    vocab = json.loads((tmp_path / "tvdpp" / "draft_vocab.json").read_text())["ids"]
    assert len(vocab) == 300 and vocab == sorted(vocab) and run["run"]["draft_vocab_size"] == 300
    code, err = run_main("training.distill", *args(tiny_target_dir, chat_file, tmp_path / "mismatch", "--select",
                                                   "adaspec", "--reference", str(tmp_path / "tvdpp")))
    assert code == 2 and "different draft vocabulary" in err


def test_bad_input_gives_one_line_errors(tiny_target_dir, chat_file, tmp_path):
    code, err = run_main("training.distill", *args(tiny_target_dir, chat_file, tmp_path / "a", "--select",
                                                   "adaspec"))
    assert code == 2 and "--reference" in err
    code, err = run_main("training.distill", *args(tiny_target_dir, chat_file, tmp_path / "b", "--select", "adaspec",
                                                   "--reference", str(tmp_path / "missing")))
    assert code == 2 and "config.json is missing" in err
    code, err = run_main("training.distill", *args(tiny_target_dir, tmp_path / "none.json", tmp_path / "c"))
    assert code == 2 and "error:" in err and "Traceback" not in err
