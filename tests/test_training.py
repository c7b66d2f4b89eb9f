"""Token-alignable training: masks, version-mixed attention, EAGLE equivalence, learning, resume, two processes."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from griffin import DraftConfig, DraftModel
from tests.conftest import ROOT, run_main, run_module, tiny_model
from tests.test_features import conversations, write_data
from training.objective import MultiPassObjective, make_batch, next_masks, version_mixed_mask
from training.store import Conversation


def test_mask_recurrence_on_hand_built_examples():
    m1 = torch.tensor([[1.0, 1, 1, 1, 0, 1, 1]])
    a1 = torch.tensor([[1.0, 0, 1, 1, 1, 1, 0]])
    data = torch.tensor([[1.0, 1, 1, 1, 1, 0, 1]])
    # m2_t = m1_{t-1} * a1_{t-1} * data_t, and m2_0 = 0
    assert next_masks(m1, a1, data).tolist() == [[0, 1, 0, 1, 1, 0, 1]]
    m2 = next_masks(m1, a1, data)
    a2 = torch.tensor([[1.0, 1, 1, 0, 1, 1, 1]])
    assert next_masks(m2, a2, data).tolist() == [[0, 0, 1, 0, 0, 0, 0]]


def test_version_mixed_mask_layout():
    valid = torch.tensor([[True, True, True, True]])
    mask = version_mixed_mask(3, valid)[0, 0].int()  # [4, 12]: keys of versions 0 | 1 | 2
    v0, v1, v2 = mask[:, :4], mask[:, 4:8], mask[:, 8:]
    assert v2.tolist() == torch.eye(4, dtype=torch.int).tolist()  # d = 0 -> version k-1
    assert v1.tolist() == torch.eye(4, dtype=torch.int).roll(-1, 1).tril().tolist()  # d = 1 -> version 1
    assert v0.tolist() == torch.ones(4, 4, dtype=torch.int).tril(-2).tolist()  # d >= 2 -> version 0
    assert version_mixed_mask(1, valid)[0, 0].tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_version_mixed_attention_equals_naive_reference(k):
    torch.manual_seed(k)
    b, t, nh, nkv, d = 2, 7, 4, 2, 8
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, 5:] = False  # padding
    q = torch.randn(b, nh, t, d)
    keys = [torch.randn(b, nkv, t, d) for _ in range(k)]
    values = [torch.randn(b, nkv, t, d) for _ in range(k)]
    got = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                         attn_mask=version_mixed_mask(k, valid), enable_gqa=True)
    for bi in range(b):
        for ti in range(t):
            ks, vs = [], []
            for s in range(ti + 1):
                if valid[bi, s]:
                    version = max(k - 1 - (ti - s), 0)
                    ks.append(keys[version][bi, :, s])
                    vs.append(values[version][bi, :, s])
            kk = torch.stack(ks, 1).repeat_interleave(nh // nkv, 0)  # [nh, S, d]
            vv = torch.stack(vs, 1).repeat_interleave(nh // nkv, 0)
            att = ((q[bi, :, ti, None] @ kk.transpose(1, 2)) / math.sqrt(d)).softmax(-1)  # [nh, 1, S]
            want = (att @ vv)[:, 0]
            torch.testing.assert_close(got[bi, :, ti], want, rtol=1e-5, atol=1e-5)


def synthetic_items(target, n: int, length: int, seed: int = 0) -> list[Conversation]:
    """Sequences the target wrote itself (greedy after 3 random tokens), so true next tokens are its argmaxes."""
    gen = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        prompt = torch.randint(0, target.config.vocab_size, (1, 3), generator=gen)
        with torch.no_grad():
            ids = target.generate(prompt, max_new_tokens=length - 3 - i % 3, do_sample=False, min_new_tokens=1)[0]
        with torch.no_grad():
            hidden = target(ids[None], output_hidden_states=True).hidden_states[-1][0]
        mask = torch.ones(len(ids), dtype=torch.uint8)
        mask[:3] = 0
        items.append(Conversation(ids, mask, hidden))
    return items


def test_single_pass_equals_plain_eagle_training():
    target = tiny_model(vocab_size=60, hidden=32)
    draft = DraftModel(DraftConfig.from_target(target.config, arch="eagle")).attach(target)
    batch = make_batch(synthetic_items(target, 3, 12))
    objective = MultiPassObjective(draft, steps=1, topk=3).eval()  # eval: no feature noise
    got = objective(batch)
    b, t = batch.tokens.shape
    # EAGLE: causal attention over (x_{t+1}, F_t); loss = SmoothL1(F_hat, F_{t+1}) + 0.1 CE(p_{t+1}, q_t)
    valid = batch.valid
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    out = draft(batch.tokens, batch.features, torch.arange(t)[None].expand(b, t), mask)
    p = F.softmax(F.linear(batch.targets, target.lm_head.weight), -1)
    ce = -(p * F.log_softmax(F.linear(out.predict, target.lm_head.weight), -1)).sum(-1)
    reg = F.smooth_l1_loss(out.predict, batch.targets, reduction="none").mean(-1)
    m = batch.data_mask * valid
    torch.testing.assert_close(got["loss_sums"][0], ((reg + 0.1 * ce) * m).sum(), rtol=1e-5, atol=1e-5)
    assert got["counts"].tolist() == [m.sum().item()]


def test_loss_falls_when_overfitting_eight_sequences():
    target = tiny_model(vocab_size=60, hidden=32)
    torch.manual_seed(0)
    draft = DraftModel(DraftConfig.from_target(target.config, arch="griffin")).attach(target)
    objective = MultiPassObjective(draft, steps=3, topk=3)
    batch = make_batch(synthetic_items(target, 8, 16))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        out = objective(batch)
        loss = (out["loss_sums"] / out["counts"].clamp(min=1)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])
    objective.eval()
    out = objective(batch)
    assert (out["top1"][0] / out["counts"][0]) > 0.7  # it learned the next tokens (chance: 1/60)
    assert out["counts"][2] > 0  # later passes keep aligned positions


def test_without_a_token_mask_every_position_stays_and_accuracy_is_still_measured():
    target = tiny_model(vocab_size=60, hidden=32)
    torch.manual_seed(0)
    draft = DraftModel(DraftConfig.from_target(target.config, arch="eagle")).attach(target)
    batch = make_batch(synthetic_items(target, 3, 12))
    hass = MultiPassObjective(draft, steps=3, topk=0).eval()(batch)
    masked = MultiPassObjective(draft, steps=3, topk=3).eval()(batch)
    data = batch.data_mask * batch.valid
    shifted = torch.zeros_like(data)
    shifted[:, 1:] = data[:, :-1]
    assert hass["counts"][1] == (shifted * data).sum()  # HASS: only the data mask, carried one position per pass
    assert masked["counts"][1] < hass["counts"][1]  # an untrained head misses most tokens: the top-3 mask drops them
    assert hass["top1"][0] == masked["top1"][0] and hass["topk"][0] == masked["topk"][0]  # real top-1 / top-3 hits
    assert hass["topk"][0] < hass["counts"][0]


# --- the command line --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory, tiny_target_dir):
    folder = tmp_path_factory.mktemp("store")
    data = write_data(folder / "d.json", conversations(40, words=20))
    res = run_module("training.build_features", "--target", str(tiny_target_dir), "--data", data, "--out",
                     str(folder / "features"), "--max-len", "160", "--shard-size", "10")
    assert res.returncode == 0, res.stderr
    return folder / "features"


def weights(folder) -> dict:
    return load_file(str(folder / "model.safetensors"))


def test_train_cli_writes_a_loadable_head_and_validation(tmp_path, tiny_store):
    out = tmp_path / "head"
    res = run_module("training.train", "--features", str(tiny_store), "--out", str(out), "--steps", "2",
                     "--batch-size", "4", "--epochs", "2", "--lr", "1e-3", "--draft-vocab", "300")
    assert res.returncode == 0, res.stderr
    head = DraftModel.from_pretrained(out)
    assert head.config.draft_vocab_size == 300 and head.config.arch == "griffin"
    report = json.loads((out / "validation.json").read_text())
    assert len(report["epochs"]) == 2
    first = report["epochs"][0]["passes"]
    assert [p["pass"] for p in first] == [1, 2] and first[0]["kept"] == 1.0
    assert {"top1", "top3", "loss", "kept"} <= set(first[1])
    assert report["epochs"][1]["passes"][0]["loss"] < first[0]["loss"] * 1.5


def test_progressive_runs_every_stage(tmp_path, tiny_store):
    out = tmp_path / "prog"
    res = run_module("training.train", "--features", str(tiny_store), "--out", str(out), "--steps", "3",
                     "--progressive", "--batch-size", "8", "--max-updates", "2")
    assert res.returncode == 0, res.stderr
    for k in (1, 2, 3):
        stage = json.loads((out / f"stage-{k}" / "validation.json").read_text())["run"]
        assert stage["steps"] == k and (k == 1) == (stage["init_from"] is None)
    assert len(json.loads((out / "validation.json").read_text())["epochs"][0]["passes"]) == 3


def test_resume_after_sigkill_ends_with_the_same_weights(tmp_path, tiny_store):
    args = ["--features", str(tiny_store), "--steps", "2", "--batch-size", "2", "--max-updates", "40",
            "--save-every", "4", "--lr", "1e-3"]
    ref = run_module("training.train", *args, "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "training.train", *args, "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (out / "train_state" / "progress.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "validation.json").exists(), "the run finished before it could be killed"
    again = run_module("training.train", *args, "--out", str(out))
    assert again.returncode == 2 and "--resume" in again.stderr
    res = run_module("training.train", *args, "--out", str(out), "--resume")
    assert res.returncode == 0, res.stderr
    a, b = weights(tmp_path / "ref"), weights(out)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_two_processes_match_one_on_the_same_global_batch(tmp_path, tiny_store):
    args = ["--features", str(tiny_store), "--steps", "2", "--max-updates", "3", "--noise", "0", "--lr", "1e-3"]
    one = run_module("training.train", *args, "--batch-size", "4", "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29544",
                "-m"]
    two = run_module("training.train", *args, "--batch-size", "2", "--out", str(tmp_path / "two"), launcher=launcher)
    assert two.returncode == 0, two.stderr
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)
    assert json.loads((tmp_path / "two" / "validation.json").read_text())["run"]["processes"] == 2


def test_bad_training_input_gives_clear_errors(tmp_path, tiny_store, tiny_target_dir):
    def check(*args, message):
        code, err = run_main("training.train", *args)
        assert code == 2 and message in err, err

    out = ["--out", str(tmp_path / "o")]
    (tmp_path / "empty-folder").mkdir()
    check("--features", str(tmp_path / "empty-folder"), *out, message="manifest.json is missing")
    check("--features", str(tiny_store), *out, "--steps", "0", message="argument --steps: must be an integer >= 1")
    check("--features", str(tiny_store), *out, "--topk", "-1", message="argument --topk: must be an integer >= 0")
    check("--features", str(tiny_store), *out, "--target", "smollm2-135m-instruct",
          message="were built with target")
    empty = tmp_path / "no-samples"
    data = write_data(tmp_path / "e.json", [{"id": "x", "conversations": []}])
    run_main("training.build_features", "--target", str(tiny_target_dir), "--data", data, "--out", str(empty))
    check("--features", str(empty), *out, message="holds no conversations")


def test_context_vocabulary_in_the_objective():
    target = tiny_model(vocab_size=60, hidden=32)
    draft = DraftModel(DraftConfig.from_target(target.config, draft_vocab_size=4)).attach(target)
    draft.draft_vocab.copy_(torch.tensor([0, 1, 2, 3]))
    batch = make_batch(synthetic_items(target, 2, 12))
    objective = MultiPassObjective(draft, steps=1, topk=50).eval()
    static = objective(batch)
    present = set(batch.next_tokens[batch.next_tokens >= 0].tolist())
    assert not present & {0, 1, 2, 3} or static["topk"][0] < static["counts"][0]
    vocab = torch.tensor(sorted({0, 1, 2, 3} | set(batch.tokens.flatten().tolist()) | present))
    widened = objective(batch, vocab)
    # with every batch token proposable and top-50 >= vocabulary size, every known next token is in the top-k
    unknown = ((batch.next_tokens < 0) & batch.valid & (batch.data_mask > 0)).sum()  # the last position of each
    assert len(vocab) <= 50 and widened["topk"][0] == widened["counts"][0] - unknown
    assert torch.isfinite(widened["loss_sums"]).all()
