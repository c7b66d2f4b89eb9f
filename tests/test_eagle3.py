"""EAGLE-3-generation heads (``eagle3``, ``griffin3``): config, the fused features the engine hands them, lossless
decoding with them, and training-time test (TTT) against an explicit per-position draft chain."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from griffin import SpecGenerator
from griffin.config import DraftConfig, default_feature_layers
from griffin.draft import DraftModel
from griffin.drafters import HeadDrafter
from griffin.official import save_eagle3
from griffin.sampling import SamplingConfig
from griffin.target import TargetHead
from tests.conftest import ROOT, pooled_chisquare, run_main, tiny_model
from tests.test_features import conversations, write_data
from tests.test_generation import NoTokenizer, exact_sequences, greedy_difference, untrained_head
from tests.test_training import synthetic_items
from training.objective import MultiPassObjective, make_batch
from training.store import Conversation, FeatureStore

FUSED = ["eagle3", "griffin3"]


def test_default_layers_and_config_checks():
    assert default_feature_layers(32) == [2, 16, 29]  # EAGLE-3's (2, N//2, N-3)
    target = tiny_model(layers=6)
    cfg = DraftConfig.from_target(target.config, arch="eagle3", draft_vocab_size=32)
    assert cfg.feature_layers == [2, 3, 3] and not cfg.fc_bias and not cfg.context_vocab and cfg.feature_size == 192
    assert DraftConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="context_vocab must be false"):
        DraftConfig.from_target(target.config, arch="eagle3", context_vocab=True)
    with pytest.raises(ValueError, match="three layer indices"):
        DraftConfig.from_target(target.config, arch="griffin3", feature_layers=[1, 2])
    with pytest.raises(ValueError, match="feature_layers is for the fused archs"):
        DraftConfig.from_target(target.config, arch="griffin", feature_layers=[1, 2, 3])
    head = DraftModel(DraftConfig.from_target(target.config, arch="eagle3", feature_layers=[1, 2, 9]))
    with pytest.raises(ValueError, match="reads target layers \\[1, 2, 9\\] but the target has 6 layers"):
        head.attach(target)


def test_head_shapes_and_fc_bypass():
    """fc reduces 3H target features; a fed-back H feature skips it. griffin3 adds TGF and dual heads."""
    target = tiny_model(layers=6)
    for arch in FUSED:
        head = untrained_head(target, arch, draft_vocab_size=32).attach(target)
        ids = torch.randint(0, 128, (1, 5))
        out = head(ids, torch.randn(1, 5, 192), torch.arange(5)[None])
        assert out.predict.shape == out.regress.shape == (1, 5, 64)
        assert head.logits(out.predict).shape == (1, 5, 32)
        again = head(ids, out.regress, torch.arange(5)[None])  # H wide: no fc
        assert again.predict.shape == (1, 5, 64)
        assert head.layer.self_attn.q_proj.in_features == 128  # cat(norm(e), norm(h))
        assert (head.fusion.tgf is not None) == (arch == "griffin3")
        dual = not torch.equal(out.predict, head.norm(out.regress))
        assert dual == (arch == "griffin3")


def test_verification_returns_the_fused_features_of_accepted_tokens():
    """The drafter receives, for every accepted token, the hidden states entering the head's three target layers, as
    a full forward of the final sequence computes them (no second forward in the engine)."""
    target = tiny_model(layers=6, vocab_size=96)
    head = untrained_head(target, "griffin3", draft_vocab_size=48)
    gen = SpecGenerator(target, NoTokenizer(), head, depth=3, top_k=3, total_tokens=8)
    received = []
    accept = type(gen.make_drafter(64)).accept

    def spy(self, tokens, hidden):
        received.append(hidden.clone())
        return accept(self, tokens, hidden)

    prompt = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(3))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(gen.make_drafter(64)), "accept", spy)
        out = gen.generate(prompt, max_new_tokens=12)
    seq = out.sequences[0]
    with torch.no_grad():
        states = target.model(seq[None], output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in head.config.feature_layers], dim=-1)  # [L, 3H]
    got = torch.cat(received)  # the prompt's positions, then each cycle's accepted ones
    assert got.shape[1] == 3 * 64
    torch.testing.assert_close(got, want[: got.shape[0]], rtol=1e-4, atol=1e-4)


def check_fused_identity(family: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Untrained eagle3 and griffin3 heads over three tree shapes give exactly transformers' greedy tokens."""
    target = tiny_model(family, vocab_size=96, layers=6).to(device=device, dtype=dtype)
    failures = []
    for arch in FUSED:
        for depth, top_k, total in [(1, 1, 1), (3, 2, 4), (5, 4, 12)]:
            gen = SpecGenerator(target, NoTokenizer(), untrained_head(target, arch, draft_vocab_size=40),
                                depth=depth, top_k=top_k, total_tokens=total, draft_dtype=dtype)
            for seed in range(2):
                prompt = torch.randint(0, 96, (5 + seed,), generator=torch.Generator().manual_seed(seed)).to(device)
                ref = target.generate(prompt[None], max_new_tokens=20, do_sample=False)
                problem = greedy_difference(target, gen.generate(prompt, max_new_tokens=20).sequences, ref)
                if problem:
                    failures.append(f"{arch} {(depth, top_k, total)} seed {seed}: {problem}")
    assert not failures, f"{family} at {dtype}:\n" + "\n".join(failures)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_identity_with_fused_heads_over_tree_shapes(family):
    check_fused_identity(family)


def fused_items(target, n: int, length: int, layers: list[int], seed: int = 0) -> list[Conversation]:
    """synthetic_items plus the inputs of three target layers."""
    items = synthetic_items(target, n, length, seed)
    for item in items:
        with torch.no_grad():
            states = target(item.input_ids[None], output_hidden_states=True).hidden_states
        item.layers = torch.cat([states[i][0] for i in layers], dim=-1)
    return items


def explicit_ttt_chain(draft: DraftModel, batch, b: int, t: int, k: int, topk: int):
    """Pass ``k`` at ``t`` as drafting runs it: the context up to ``t-k+1`` with the target's fused features, then
    ``k-1`` draft steps, each reading the regress output of the step before (through no fc), plain causal attention.
    -> (logits at t, soft-label logits at t, whether each earlier step's true next token was in its top-topk)."""
    start = t - (k - 1)
    fused = draft.fuse(batch.tokens[None, b, : start + 1], batch.features[None, b, : start + 1])
    fed = []
    aligned = True
    for u in range(start, t + 1):
        h = fused
        if fed:
            h = torch.cat((fused, draft.fuse(batch.tokens[None, b, start + 1 : u + 1], torch.stack(fed)[None])), 1)
        out = draft.forward_fused(h, torch.arange(u + 1)[None])
        logits = draft.lm_head(out.predict[0, u])
        if u < t:
            nxt = batch.next_tokens[b, u].item()
            vocab = draft.static_vocab().tolist()
            aligned = aligned and nxt in vocab and vocab.index(nxt) in logits.topk(topk).indices.tolist()
            fed.append(out.regress[0, u])
    labels = batch.targets[b, t] @ draft.lm_weight_full()[draft.static_vocab()].T
    return logits, labels, aligned


@pytest.mark.parametrize(("arch", "topk"), [("eagle3", 0), ("griffin3", 30)])
def test_ttt_rollout_equals_an_explicit_draft_chain_per_position(arch, topk):
    """The batched TTT rollout (diagonal attention through boolean masks, chains of fed-back outputs) gives at every
    counted position the logits an explicit unroll computes, and counts exactly the positions EAGLE-3 counts: an
    assistant label whose target argmax is in the draft vocabulary, on a chain the alignment mask keeps."""
    target = tiny_model(vocab_size=60, hidden=32, layers=6)
    torch.manual_seed(1)
    draft = DraftModel(DraftConfig.from_target(target.config, arch=arch, draft_vocab_size=45)).attach(target)
    draft.draft_vocab.copy_(torch.tensor([i for i in range(60) if i % 4]))  # multiples of 4 are not proposable
    steps = 4
    items = fused_items(target, 3, 14, draft.config.feature_layers, seed=2)
    for item in items:
        item.loss_mask[3:6] = 0  # chains that start in a non-assistant span still count where their label is one
    batch = make_batch(items, fused=True)
    passes = MultiPassObjective(draft, steps=steps, topk=topk, ttt=True).eval().rollout(batch)
    data = batch.data_mask * batch.valid
    full = batch.targets @ draft.lm_weight_full().T  # [B, T, V]
    in_vocab = (full.argmax(-1) % 4 != 0).float()
    checked = {k: 0 for k in range(1, steps + 1)}
    for b in range(batch.tokens.shape[0]):
        for t in range(int(batch.valid[b].sum())):
            for k in range(1, steps + 1):
                out = passes[k - 1]
                if t < k - 1:
                    assert out.mask[b, t] == 0
                    continue
                logits, labels, aligned = explicit_ttt_chain(draft, batch, b, t, k, topk or 45)
                counted = (aligned or not topk) and bool(data[b, t]) and bool(in_vocab[b, t])
                assert out.mask[b, t].item() == float(counted), (b, t, k)
                if counted:
                    row = out.row_of(b, t)
                    torch.testing.assert_close(out.logits[row], logits, rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(out.target_logits[row], labels, rtol=1e-4, atol=1e-4)
                checked[k] += counted
    assert all(checked[k] > 0 for k in checked), checked
    if topk:
        assert checked[steps] < checked[1]


@pytest.mark.parametrize(("arch", "topk"), [("eagle3", 0), ("griffin3", 30)])
def test_the_rollouts_own_soft_ce_trains_and_reports_as_the_logits_do(arch, topk):
    """Scoring the soft-CE inside the rollout, without [N, V] logits (the objective's default for a fused head), gives
    the losses, counts, hits and gradients of scoring its logits afterwards."""
    target = tiny_model(vocab_size=60, hidden=32, layers=6)
    torch.manual_seed(3)
    draft = DraftModel(DraftConfig.from_target(target.config, arch=arch, draft_vocab_size=45)).attach(target)
    draft.draft_vocab.copy_(torch.tensor([i for i in range(60) if i % 4]))
    batch = make_batch(fused_items(target, 3, 14, draft.config.feature_layers, seed=5), fused=True)
    objective = MultiPassObjective(draft, steps=4, topk=topk, ttt=True)
    assert objective.soft_ce
    results = []
    for soft_ce in (True, False):
        objective.soft_ce = soft_ce
        out = objective(batch, generator=torch.Generator().manual_seed(0))
        loss = (out["loss_sums"] / out["counts"].clamp(min=1) * objective.pass_weights).sum()
        results.append((out, torch.autograd.grad(loss, list(draft.parameters()), allow_unused=True)))
    (scored, scored_grads), (logits, logits_grads) = results
    for key in ("counts", "kept", "top1", "topk"):
        assert torch.equal(scored[key], logits[key]), key
    assert (scored["counts"] > 0).all()
    torch.testing.assert_close(scored["loss_sums"], logits["loss_sums"], rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(scored_grads, logits_grads, strict=True):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


def test_ttt_learns_through_its_own_outputs_and_weighs_passes():
    """TTT keeps the gradient of the fed-back features (TAT detaches them); pass i+1 weighs 0.8**i; no feature loss."""
    target = tiny_model(vocab_size=60, hidden=32, layers=6)
    torch.manual_seed(0)
    draft = DraftModel(DraftConfig.from_target(target.config, arch="eagle3", draft_vocab_size=30)).attach(target)
    draft.draft_vocab.copy_(torch.arange(30))
    batch = make_batch(fused_items(target, 2, 12, draft.config.feature_layers), fused=True)
    for ttt in (True, False):
        objective = MultiPassObjective(draft, steps=3, topk=0, ttt=ttt).eval()
        passes = objective.rollout(batch)
        grad = torch.autograd.grad(passes[1].logits.sum(), passes[0].regress, allow_unused=True)[0]
        assert (grad is not None and grad.abs().sum() > 0) == ttt
    objective = MultiPassObjective(draft, steps=3, topk=0, ttt=True).eval()
    torch.testing.assert_close(objective.pass_weights, torch.tensor([1.0, 0.8, 0.64]))
    assert objective.loss.w_regress == 0


def test_sampling_with_a_fused_head_matches_the_target_distribution():
    target = tiny_model("llama", vocab_size=5, hidden=16, layers=4, seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target, "griffin3"), depth=2, top_k=2, total_tokens=3)
    prompt = torch.tensor([1, 3, 0])
    exact = exact_sequences(target, prompt, SamplingConfig(temperature=0.8, top_k=3), length=3)
    runs = 1200
    counts: dict[tuple, int] = {}
    for seed in range(runs):
        out = gen.generate(prompt, max_new_tokens=3, temperature=0.8, top_k=3, seed=seed)
        key = tuple(out.sequences[0, 3:].tolist())
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact)
    pvalue, cells = pooled_chisquare(counts, exact, runs)
    assert cells > 10 and pvalue > 0.001, (pvalue, counts)


# --- the EAGLE-3 layout: the official code's outputs, and what vLLM / SGLang load --------------------------------

FIXTURE = ROOT / "tests" / "fixtures" / "official-eagle3"  # made with the official code: see fixtures/PROVENANCE.md


def fixture_head() -> tuple[DraftModel, dict[str, torch.Tensor], dict[str, int]]:
    """The official checkpoint loaded and attached to a stand-in target with the fixture's embedding; its lm_head
    makes token 9 (a draft token) every position's argmax, so that TTT counts every assistant position."""
    io = load_file(str(FIXTURE / "io.safetensors"))
    with safe_open(str(FIXTURE / "io.safetensors"), "pt") as handle:
        meta = {k: int(v) for k, v in handle.metadata().items() if v.isdigit()}
    head = DraftModel.from_pretrained(FIXTURE)
    lm_head = torch.zeros(128, 64)
    lm_head[9, 0] = 1.0
    target = TargetHead(LlamaConfig(hidden_size=64, vocab_size=128, intermediate_size=96, num_attention_heads=4,
                                    num_key_value_heads=2, num_hidden_layers=6), io["embed_tokens"], lm_head)
    return head.attach(target), io, meta


def test_the_official_eagle3_checkpoint_reproduces_the_official_code():
    """Loader, step-0 forward, every step of training-time test and the drafted tree against the official EAGLE-3
    code's outputs on the same weights (tests/fixtures/official-eagle3)."""
    head, io, meta = fixture_head()
    assert head.config.arch == "eagle3" and head.config.feature_layers == [2, 3, 3]  # EAGLE-3's default, when attached
    assert head.static_vocab().tolist() == [9, 24, 30, 31, 36, 42, 46, 49, 51, 53, 66, 68, 69, 72, 78, 81, 82, 87, 88,
                                            93, 102, 104, 105, 106, 107, 110, 111, 114, 117, 119, 124, 125]
    ids, hidden3 = io["input_ids"], io["hidden3"]
    out = head(ids[:, 1:], hidden3, torch.arange(12)[None])
    torch.testing.assert_close(out.regress, io["step0_hidden"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.logits(out.predict), io["step0_logits"], rtol=1e-5, atol=1e-5)

    # TTT: the official step i at row u is our pass i+1 at position u+i (tokens x_{u+i+1}, RoPE position u+i)
    steps = meta["ttt_steps"]
    ttt_ids = io["ttt_input_ids"][0]
    targets = torch.zeros(12, 64)
    targets[:, 0] = 1.0
    item = Conversation(ttt_ids, torch.ones(12, dtype=torch.uint8), targets, io["hidden3"][0])
    passes = MultiPassObjective(head, steps=steps, topk=0, ttt=True).eval().rollout(make_batch([item], fused=True))
    compared = 0
    for i in range(steps):
        for u in range(11 - i):
            row = passes[i].row_of(0, u + i)
            torch.testing.assert_close(passes[i].logits[row], io["ttt_logits"][i, 0, u], rtol=1e-5, atol=1e-5)
            compared += 1
    assert compared == sum(11 - i for i in range(steps))

    drafter = HeadDrafter(head, depth=meta["depth"] + 1, top_k=meta["top_k"], total_tokens=meta["total_tokens"] - 1,
                          capacity=64)
    drafter.start(ids[0, :-1], hidden3[0], ids[0, -1:])
    tree = drafter.propose(ids[0, -1:])
    assert tree.tokens.tolist() == io["draft_tokens"][0].tolist()
    assert tree.depths.tolist() == io["tree_position_ids"].tolist()
    assert torch.equal(tree.ancestors, io["tree_mask"][0, 0].bool())


def test_eagle3_export_is_what_vllm_and_sglang_load_and_round_trips(tmp_path):
    """``save_eagle3`` writes the keys, shapes and config the serving engines' EAGLE-3 loaders read, checked against
    their source: vLLM ``vllm/model_executor/models/llama_eagle3.py`` (commit 583507d: q/k/v take 2H, ``fc`` [H, 3 x
    target_hidden_size] without bias, ``midlayer.`` renamed ``layers.0.``, ``d2t`` -> ``draft_id_to_target_id``,
    ``t2d`` skipped, ``lm_head`` [draft_vocab_size, H], any other key a KeyError) and SGLang
    ``python/sglang/srt/models/llama_eagle3.py`` (commit d737979: ``LlamaForCausalLMEagle3``, num_hidden_layers 1,
    ``fc`` bias from an optional ``bias`` flag, ``hot_token_id = d2t + arange``). Our loader reads it back."""
    target = tiny_model(layers=6)
    torch.manual_seed(0)
    head = DraftModel(DraftConfig.from_target(target.config, arch="eagle3", draft_vocab_size=32))
    head.draft_vocab.copy_(torch.arange(0, 128, 4))
    for p in head.parameters():
        p.data.normal_(0, 0.1)
    save_eagle3(head, tmp_path / "exp", dtype=torch.float32)
    state = load_file(str(tmp_path / "exp" / "model.safetensors"))
    raw = json.loads((tmp_path / "exp" / "config.json").read_text())
    layer = {f"midlayer.{k}" for k in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                       "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                       "mlp.down_proj.weight", "input_layernorm.weight", "hidden_norm.weight",
                                       "post_attention_layernorm.weight")}
    assert set(state) == layer | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert state["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # 2H in
    assert state["fc.weight"].shape == (64, 3 * raw["target_hidden_size"])
    assert state["lm_head.weight"].shape == (raw["draft_vocab_size"], 64) == (32, 64)
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert torch.equal(state["d2t"] + torch.arange(32), torch.arange(0, 128, 4))  # SGLang's hot_token_id
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["num_hidden_layers"] == 1
    assert raw["bias"] is False and "eagle_aux_hidden_state_layer_ids" not in raw  # EAGLE-3's default layers
    back = DraftModel.from_pretrained(tmp_path / "exp", target_config=target.config).attach(target)
    assert back.config.feature_layers == head.config.feature_layers
    head.attach(target)
    ids, feats = torch.randint(0, 128, (1, 6)), torch.randn(1, 6, 192)
    mine, theirs = head(ids, feats, torch.arange(6)[None]), back(ids, feats, torch.arange(6)[None])
    torch.testing.assert_close(back.logits(theirs.predict), head.logits(mine.predict))
    griffin3 = DraftModel(DraftConfig.from_target(target.config, arch="griffin3", draft_vocab_size=32))
    with pytest.raises(ValueError, match="Token-Guided Fusion and dual heads change the forward"):
        save_eagle3(griffin3, tmp_path / "no")
    assert not (tmp_path / "no").exists()


def test_commands_build_train_and_export_fused_heads(tmp_path, tiny_target_dir):
    """build_features --feature-layers, train --arch eagle3 / griffin3 (TTT by default), export --format eagle3; the
    mistakes a user can make get one line each."""
    data = write_data(tmp_path / "data.json", conversations(10))
    plain, layered = tmp_path / "plain", tmp_path / "layered"
    common = ["--target", str(tiny_target_dir), "--data", data, "--max-len", "256"]
    assert run_main("training.build_features", "--out", str(plain), *common)[0] == 0
    assert run_main("training.build_features", "--out", str(layered), "--feature-layers", "auto", *common)[0] == 0
    store = FeatureStore(layered)
    assert store.feature_layers == [1, 1, 0] and store[0].layers.shape == (len(store[0].input_ids), 96)
    torch.testing.assert_close(store[0].hidden, FeatureStore(plain)[0].hidden)
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    with torch.no_grad():  # the target's top tokens come along, so that TTT need not run the whole lm_head
        assert torch.equal(store[2].argmax, target(store[2].input_ids[None]).logits[0].argmax(-1))
    assert FeatureStore(plain)[0].argmax is None
    code, err = run_main("training.build_features", "--out", str(tmp_path / "x"), "--feature-layers", "1,2", *common)
    assert code == 2 and "three layer indices" in err
    code, err = run_main("training.train", "--features", str(plain), "--out", str(tmp_path / "no"), "--arch", "eagle3")
    assert code == 2 and "--feature-layers auto" in err and len(err.strip().splitlines()) == 1
    train = ["--features", str(layered), "--draft-vocab", "64", "--max-updates", "2", "--batch-size", "2",
             "--ttt-steps", "3"]
    for arch, topk in (("eagle3", "0"), ("griffin3", "3")):
        assert run_main("training.train", *train, "--arch", arch, "--topk", topk, "--out", str(tmp_path / arch))[0] == 0
        report = json.loads((tmp_path / arch / "validation.json").read_text())
        assert report["run"]["ttt_steps"] == 3 and len(report["epochs"][-1]["passes"]) == 3
    assert run_main("training.export", str(tmp_path / "eagle3"), str(tmp_path / "e3"), "--format", "eagle3")[0] == 0
    assert json.loads((tmp_path / "e3" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert "training-time test over 3 passes" in (tmp_path / "e3" / "README.md").read_text()
    head = DraftModel.from_pretrained(tmp_path / "e3")
    assert head.config.arch == "eagle3" and head.config.draft_vocab_size == 64
    code, err = run_main("training.export", str(tmp_path / "griffin3"), str(tmp_path / "g3"), "--format", "eagle3")
    assert code == 2 and "Token-Guided Fusion" in err and not (tmp_path / "g3").exists()


def test_online_features_give_the_batches_a_store_gives(tmp_path, tiny_target_dir):
    """``train --online`` computes a batch's features with the frozen target through the function feature building
    uses, rounded to the same storage dtype: the same batch as from a store built with --feature-layers auto; and a
    run trains from it."""
    from training.online import OnlineFeatures

    data = write_data(tmp_path / "data.json", conversations(9))
    store_dir = tmp_path / "store"
    assert run_main("training.build_features", "--out", str(store_dir), "--target", str(tiny_target_dir), "--data",
                    data, "--max-len", "256", "--feature-layers", "auto")[0] == 0
    store = FeatureStore(store_dir)
    online = OnlineFeatures(str(tiny_target_dir), [data], 256, None, "auto", torch.device("cpu"))
    assert len(online) == len(store) and online.feature_layers == store.feature_layers
    assert torch.equal(online.token_counts(), store.token_counts())
    indices = [0, 3, 5]
    mine, theirs = make_batch(online.items(indices), fused=True), make_batch(store.items(indices), fused=True)
    for name in ("tokens", "next_tokens", "data_mask", "valid"):
        assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
    for name in ("features", "targets"):  # fp16 storage either way; the forward's batch shapes differ
        torch.testing.assert_close(getattr(mine, name), getattr(theirs, name), rtol=2e-3, atol=2e-3)
    code, _ = run_main("training.train", "--online", "--target", str(tiny_target_dir), "--data", data, "--max-len",
                       "256", "--arch", "eagle3", "--draft-vocab", "64", "--ttt-steps", "2", "--max-updates", "2",
                       "--batch-size", "2", "--out", str(tmp_path / "head"))
    assert code == 0 and (tmp_path / "head" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "head" / "validation.json").read_text())["run"]["features"].startswith("online:")


def test_a_fused_heads_lm_head_and_norm_can_start_as_the_targets(tiny_target_dir):
    """``--lm-head-init target``: the trained lm_head starts as the target's rows of the draft vocabulary
    and the final norm as the target's, so an untrained head's logits are the target's logits of its features."""
    from griffin.target import load_target_head
    from training.train import init_from_target

    target = load_target_head(str(tiny_target_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    head = DraftModel(DraftConfig.from_target(target.config, arch="griffin3", draft_vocab_size=64))
    head.draft_vocab.copy_(torch.arange(0, 128, 2))
    init_from_target(head, target)
    torch.testing.assert_close(head.norm.weight, model.model.norm.weight)
    x = torch.randn(3, 32)
    torch.testing.assert_close(head.lm_head(head.norm(x)), model.lm_head(model.model.norm(x))[:, 0:128:2])


def test_fused_features_after_plain_stretches_are_the_verification_passes():
    """Adaptation runs plain steps between trees; the drafter then reads, for every emitted token, the hidden states
    entering its three target layers, as a full forward of the final sequence computes them."""
    from griffin.adapt import PLAIN
    from tests.test_adapt import BIG, SMALL, Scripted, run

    target = tiny_model(layers=6, vocab_size=96)
    gen = SpecGenerator(target, NoTokenizer(), untrained_head(target, "eagle3", draft_vocab_size=48), top_k=4)
    received = []
    drafter_type = type(gen.make_drafter(64))
    accept = drafter_type.accept

    def spy(self, tokens, hidden):
        received.append(hidden.clone())
        return accept(self, tokens, hidden)

    prompt = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(5))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(drafter_type, "accept", spy)
        out, stats = run(gen, prompt, 24, Scripted([BIG, PLAIN, PLAIN, SMALL, PLAIN, BIG]))
    assert stats.plain_steps >= 4
    with torch.no_grad():
        states = target.model(torch.cat((prompt, torch.tensor(out)))[None], output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in gen.draft.config.feature_layers], dim=-1)
    got = torch.cat(received)
    torch.testing.assert_close(got, want[: got.shape[0]], rtol=1e-4, atol=1e-4)
