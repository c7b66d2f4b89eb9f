"""Token-alignable training: masks, chain attention, EAGLE equivalence, learning, resume, two processes."""

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
from training.losses import adaspec_select, make_token_loss, per_token_fkl
from training.objective import (
    HeadLoss,
    MultiPassObjective,
    Rollout,
    chain_attention,
    make_batch,
    next_masks,
)
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


@pytest.mark.parametrize("k", [2, 3, 4])
def test_chain_attention_equals_naive_reference(k):
    """Pass k's query at t sees key s of version max(k-1-(t-s), 0) for every s <= t; version k-1 is its own new key.
    The output and the gradients of every input match one softmax over those keys."""
    torch.manual_seed(k)
    b, t, nh, nkv, d = 2, 7, 4, 2, 8
    index = torch.tensor([[3, 5, 6], [k - 1, 4, 6]])  # [B, Tq] query positions, each far enough for its chain
    q = torch.randn(b, nh, 3, d, requires_grad=True)
    keys = [torch.randn(b, nkv, t, d, requires_grad=True) for _ in range(k - 1)]
    values = [torch.randn(b, nkv, t, d, requires_grad=True) for _ in range(k - 1)]
    k_new, v_new = torch.randn(b, nkv, 3, d, requires_grad=True), torch.randn(b, nkv, 3, d, requires_grad=True)
    got = Rollout.chain(index, k, keys, values)(q, k_new, v_new)  # [B, nh, Tq, D]
    want = torch.zeros_like(got)
    for bi in range(b):
        for j, ti in enumerate(index[bi].tolist()):
            ks, vs = [], []
            for s in range(ti + 1):
                version = max(k - 1 - (ti - s), 0)
                ks.append(k_new[bi, :, j] if version == k - 1 else keys[version][bi, :, s])
                vs.append(v_new[bi, :, j] if version == k - 1 else values[version][bi, :, s])
            kk = torch.stack(ks, 1).repeat_interleave(nh // nkv, 0)  # [nh, S, d]
            vv = torch.stack(vs, 1).repeat_interleave(nh // nkv, 0)
            att = ((q[bi, :, j, None] @ kk.transpose(1, 2)) / math.sqrt(d)).softmax(-1)  # [nh, 1, S]
            want[bi, :, j] = (att @ vv)[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    inputs = [q, k_new, v_new, *keys, *values]
    weights = torch.randn_like(got)
    for g_got, g_want in zip(torch.autograd.grad((got * weights).sum(), inputs),
                             torch.autograd.grad((want * weights).sum(), inputs), strict=True):
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-5)


def test_chain_attention_of_a_query_without_a_prefix_reads_its_chain_only():
    """A slot whose chain would start before position 0 (a padded slot of the rollout) sees no prefix key: its output
    is its chain's own attention, finite, not an average with masked-out keys."""
    torch.manual_seed(0)
    b, nh, nkv, t, c, d = 1, 2, 1, 5, 2, 4
    q = torch.randn(b, nh, 1, d)
    chain_keys, chain_values = torch.randn(b, nkv, 1, c, d), torch.randn(b, nkv, 1, c, d)
    got = chain_attention(q, torch.randn(b, nkv, t, d), torch.randn(b, nkv, t, d), chain_keys, chain_values,
                          torch.tensor([[-1]]))
    att = (q[0, :, 0] @ chain_keys[0, 0, 0].T / math.sqrt(d)).softmax(-1)  # [nh, C]
    torch.testing.assert_close(got[0, :, 0], att @ chain_values[0, 0, 0])


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
                     "--progressive", "--batch-size", "8", "--max-updates", "2", "--draft-vocab", "300")
    assert res.returncode == 0, res.stderr
    for k in (1, 2, 3):
        stage = json.loads((out / f"stage-{k}" / "validation.json").read_text())["run"]
        assert stage["steps"] == k and (k == 1) == (stage["init_from"] is None)
    assert len(json.loads((out / "validation.json").read_text())["epochs"][0]["passes"]) == 3


def test_resume_after_sigkill_ends_with_the_same_weights(tmp_path, tiny_store):
    args = ["--features", str(tiny_store), "--steps", "2", "--batch-size", "2", "--max-updates", "30",
            "--save-every", "4", "--lr", "1e-3", "--draft-vocab", "300"]
    code, err = run_main("training.train", *args, "--out", str(tmp_path / "ref"))
    assert code == 0, err
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
    code, err = run_main("training.train", *args, "--out", str(out))
    assert code == 2 and "--resume" in err
    code, err = run_main("training.train", *args, "--out", str(out), "--resume")
    assert code == 0, err
    a, b = weights(tmp_path / "ref"), weights(out)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_two_processes_match_one_on_the_same_global_batch(tmp_path, tiny_store):
    args = ["--features", str(tiny_store), "--steps", "2", "--max-updates", "3", "--noise", "0", "--lr", "1e-3",
            "--draft-vocab", "300"]
    code, err = run_main("training.train", *args, "--batch-size", "4", "--out", str(tmp_path / "one"))
    assert code == 0, err
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
    check("--features", str(empty), *out, message="manifest.json is missing")  # the failed build left no manifest


def batch_vocab(draft: DraftModel, batch) -> torch.Tensor:
    """The static draft vocabulary plus every token of the batch (what the trainer passes)."""
    present = torch.cat((batch.tokens[batch.valid], batch.next_tokens[batch.next_tokens >= 0]))
    return torch.unique(torch.cat((draft.static_vocab(), present)))


def context_head(target, arch: str = "griffin", static=(0, 1, 2, 3)) -> DraftModel:
    draft = DraftModel(DraftConfig.from_target(target.config, arch=arch, draft_vocab_size=len(static))).attach(target)
    draft.draft_vocab.copy_(torch.tensor(static))
    return draft


def test_context_vocabulary_grows_along_the_conversation_only():
    target = tiny_model(vocab_size=60, hidden=32)
    draft = context_head(target)
    batch = make_batch(synthetic_items(target, 2, 12))
    objective = MultiPassObjective(draft, steps=1, topk=50).eval()
    static = objective(batch)
    present = set(batch.next_tokens[batch.next_tokens >= 0].tolist())
    assert not present & {0, 1, 2, 3} or static["topk"][0] < static["counts"][0]
    vocab = batch_vocab(draft, batch)
    passes = objective.rollout(batch, vocab)
    out = objective(batch, vocab)
    assert len(vocab) <= 50 and torch.isfinite(out["loss_sums"]).all()
    # top-50 covers every proposable token: the true next token x_{t+2} is a hit iff it is static or the
    # conversation showed it at or before x_{t+1} (position t reads x_{t+1}); later tokens are not proposable yet.
    # Only the positions of the data mask carry logits (and hits)
    first = passes[0]
    hits, want = first.hitk, torch.zeros_like(first.hitk)
    assert torch.equal(first.mask, batch.data_mask * batch.valid) and len(first.rows) == first.mask.sum()
    for b in range(batch.tokens.shape[0]):
        for t in range(batch.tokens.shape[1]):
            row = first.row_of(b, t)
            assert (row is not None) == bool(first.mask[b, t])
            if row is None:
                continue
            nxt = batch.next_tokens[b, t].item()
            context = set(batch.tokens[b, : t + 1].tolist())
            want[b, t] = float(nxt >= 0 and (nxt in {0, 1, 2, 3} or nxt in context))
            local = vocab.tolist()
            proposable = torch.isfinite(first.logits[row])
            assert proposable.tolist() == [v in {0, 1, 2, 3} or v in context for v in local]
            assert torch.equal(torch.isfinite(first.target_logits[row]), proposable)
    assert torch.equal(hits, want) and 0 < want.sum() < first.mask.sum()


def explicit_chain(draft: DraftModel, batch, vocab: torch.Tensor, b: int, t: int, k: int, topk: int):
    """Pass ``k`` at position ``t`` as the drafting engine would run it: context up to position ``t-k+1`` with target
    features, then ``k-1`` draft steps, each reading the regress feature of the step before, with plain causal
    attention. -> (logits at t, soft-label logits at t, whether every earlier step's true next token was in its
    top-``topk``, regress feature at t)."""
    start = t - (k - 1)
    static = set(draft.static_vocab().tolist())
    context = set(batch.tokens[b, : start + 1].tolist())  # tokens up to x_{start+1}: the tree's context
    blocked = torch.tensor([v not in static and v not in context for v in vocab.tolist()])
    weight = draft.lm_weight_full()[vocab]
    features = batch.features[b, : start + 1]
    aligned = True
    for u in range(start, t + 1):
        out = draft(batch.tokens[None, b, : u + 1], features[None], torch.arange(u + 1)[None])  # causal
        logits = (out.predict[0, u] @ weight.T).masked_fill(blocked, -torch.inf)
        if u < t:
            nxt = batch.next_tokens[b, u].item()
            top = set(vocab[logits.topk(topk).indices].tolist())
            aligned = aligned and nxt in top and not blocked[vocab.tolist().index(nxt)]
            features = torch.cat((features, out.regress[0, u : u + 1]))
    labels = (batch.targets[b, t] @ weight.T).masked_fill(blocked, -torch.inf)
    return logits, labels, aligned, out.regress[0, t]


@pytest.mark.parametrize("arch", ["griffin", "eagle"])
def test_rollout_equals_an_explicit_draft_chain_per_position(arch):
    target = tiny_model(vocab_size=60, hidden=32)
    torch.manual_seed(1)
    draft = context_head(target, arch, static=tuple(range(0, 60, 3)))
    steps, topk = 3, 16
    batch = make_batch(synthetic_items(target, 3, 14, seed=2))
    vocab = batch_vocab(draft, batch)
    passes = MultiPassObjective(draft, steps=steps, topk=topk).eval().rollout(batch, vocab)
    data = batch.data_mask * batch.valid
    checked = {k: 0 for k in range(1, steps + 1)}
    for b in range(batch.tokens.shape[0]):
        for t in range(int(batch.valid[b].sum())):
            for k in range(1, steps + 1):
                out = passes[k - 1]
                if t < k - 1:
                    assert out.mask[b, t] == 0  # a chain cannot start before the conversation
                    continue
                logits, labels, aligned, regress = explicit_chain(draft, batch, vocab, b, t, k, topk)
                kept = aligned and bool(data[b, t - k + 1 : t + 1].all())
                assert out.mask[b, t].item() == float(kept), (b, t, k)
                row = out.row_of(b, t)
                assert (row is not None) == kept, (b, t, k)
                if kept:  # the rollout computes the kept positions only
                    torch.testing.assert_close(out.regress[row], regress, rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(out.logits[row], logits, rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(out.target_logits[row], labels, rtol=1e-4, atol=1e-4)
                checked[k] += kept
    assert all(checked[k] > 0 for k in checked), checked  # every pass keeps some positions
    assert checked[3] < checked[1]


# --- distillation objectives and AdaSPEC -------------------------------------------------------------------------


def draft_reference_and_batch():
    """Two differently initialised GRIFFIN heads of one tiny target, and a batch of 4 conversations."""
    target = tiny_model(vocab_size=60, hidden=32)
    torch.manual_seed(0)
    draft = DraftModel(DraftConfig.from_target(target.config, arch="griffin")).attach(target)
    torch.manual_seed(1)
    reference = DraftModel(DraftConfig.from_target(target.config, arch="griffin")).attach(target)
    return draft, reference, make_batch(synthetic_items(target, 4, 14))


def test_adaspec_trains_on_the_top_fraction_of_aligned_positions_by_delta():
    draft, reference, batch = draft_reference_and_batch()
    objective = MultiPassObjective(draft, steps=2, topk=0, noise=0, token_loss=make_token_loss("fkl"),
                                   reference=reference, select_frac=0.4)
    out = objective(batch)
    passes = objective.rollout(batch)
    ref = Rollout(reference, 2, 0)(batch)  # topk 0 keeps the same positions as the draft's (no token mask)
    for k in range(2):
        kept = passes[k].mask.bool()
        assert torch.equal(ref[k].rows, passes[k].rows)
        assert out["kept"][k] == kept.sum() and out["counts"][k] == math.ceil(0.4 * kept.sum().item())
        delta = per_token_fkl(passes[k].target_logits, passes[k].logits) - per_token_fkl(ref[k].target_logits,
                                                                                         ref[k].logits)  # [N]
        chosen = adaspec_select(delta, torch.ones_like(delta), 0.4)
        want, _ = HeadLoss(make_token_loss("fkl"))(passes[k], batch.targets, chosen)
        torch.testing.assert_close(out["loss_sums"][k], want)
        assert delta[chosen].min() >= delta[~chosen].max()
    assert torch.equal(objective.eval()(batch)["counts"], out["kept"])  # validation scores every aligned position


def test_a_reference_rollout_scores_the_drafts_positions():
    draft, reference, batch = draft_reference_and_batch()
    passes = Rollout(draft, 3, topk=2, noise=0)(batch)
    own = Rollout(reference, 3, topk=0, noise=0)(batch)  # no token mask: a superset of the draft's positions
    forced = Rollout(reference, 3, topk=0, noise=0)(batch, masks=[out.mask for out in passes])
    assert len(passes[2].rows) < len(own[2].rows)
    for mine, theirs, full in zip(passes, forced, own, strict=True):
        assert torch.equal(theirs.rows, mine.rows) and torch.equal(theirs.mask, mine.mask)
        at = torch.searchsorted(full.rows, mine.rows)
        assert torch.equal(full.rows[at], mine.rows)
        torch.testing.assert_close(theirs.logits, full.logits[at])
        torch.testing.assert_close(theirs.target_logits, full.target_logits[at])


def test_distillation_flags_train_record_and_reach_the_card(tmp_path, tiny_store):
    common = ["--features", str(tiny_store), "--steps", "2", "--batch-size", "4", "--max-updates", "2",
              "--draft-vocab", "300"]
    code, err = run_main("training.train", *common, "--token-loss", "fkl", "--out", str(tmp_path / "fkl"))
    assert code == 0, err
    code, err = run_main("training.train", *common, "--token-loss", "jsd", "--jsd-beta", "0.3", "--select", "adaspec",
                         "--reference", str(tmp_path / "fkl"), "--select-frac", "0.5", "--out", str(tmp_path / "ada"))
    assert code == 0, err
    run = json.loads((tmp_path / "ada" / "validation.json").read_text())["run"]
    assert (run["token_loss"], run["jsd_beta"], run["select"], run["select_frac"]) == ("jsd", 0.3, "adaspec", 0.5)
    assert json.loads((tmp_path / "fkl" / "validation.json").read_text())["run"]["token_loss"] == "fkl"
    code, err = run_main("training.export", str(tmp_path / "ada"), str(tmp_path / "card"), "--results",
                         str(tmp_path))
    assert code == 0, err
    text = (tmp_path / "card" / "README.md").read_text()
    assert "JSD(β=0.3)" in text and "AdaSPEC" in text and str(tmp_path / "fkl") in text

    def check(*args, message):
        code, err = run_main("training.train", *common, "--out", str(tmp_path / "bad"), *args)
        assert code == 2 and message in err, err

    check("--select", "adaspec", message="--select adaspec needs --reference")
    check("--reference", str(tmp_path / "fkl"), message="--reference is only used by --select adaspec")
    check("--select", "adaspec", "--reference", str(tmp_path / "fkl"), "--select-frac", "0",
          message="--select-frac must be in (0, 1]")
    check("--jsd-beta", "1", message="--jsd-beta must be in (0, 1)")
    check("--token-loss", "kl", message="invalid choice")
    full = ["--features", str(tiny_store), "--out", str(tmp_path / "bad2"), "--max-updates", "1"]
    code, err = run_main("training.train", *full, "--select", "adaspec", "--reference", str(tmp_path / "fkl"))
    assert code == 2 and "another draft vocabulary" in err, err
    other = DraftModel.from_pretrained(tmp_path / "fkl")
    other.config.target["fingerprint"] = "0123456789abcdef"
    other.config.target["name"] = "another-target"
    other.save_pretrained(tmp_path / "other")
    check("--select", "adaspec", "--reference", str(tmp_path / "other"), message="was trained for target")


FRAGMENT = """
import ctypes
import torch
from training.train import release_freed_memory

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

ctypes.CDLL(None).mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks up to 32 MB from the heap (as after large frees)
big, pins = [], []
for _ in range(40):  # 320 MB of 8 MB blocks, each followed by a 2 MB block that stays alive (too large for a hole)
    big.append(torch.ones(2 << 20))
    pins.append(torch.ones(512 << 10))
del big
before = rss_mb()
assert release_freed_memory()
print(before, rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_freed_memory_returns_the_freed_heap_pages_to_the_os():
    res = subprocess.run([sys.executable, "-c", FRAGMENT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    before, after = map(float, res.stdout.split())
    assert before - after > 200, (before, after)  # the freed blocks were resident until the trim
