"""EAGLE-3-generation heads (``eagle3``, ``griffin3``): config, the fused features the engine hands them, lossless
decoding with them, and training-time test (TTT) against an explicit per-position draft chain."""

from __future__ import annotations

import pytest
import torch

from griffin import SpecGenerator
from griffin.config import DraftConfig, default_feature_layers
from griffin.draft import DraftModel
from griffin.sampling import SamplingConfig
from tests.conftest import pooled_chisquare, tiny_model
from tests.test_generation import NoTokenizer, exact_sequences, greedy_difference, untrained_head
from tests.test_training import synthetic_items
from training.objective import MultiPassObjective, make_batch
from training.store import Conversation

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


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_identity_with_fused_heads_over_tree_shapes(family):
    target = tiny_model(family, vocab_size=96, layers=6)
    failures = []
    for arch in FUSED:
        for depth, top_k, total in [(1, 1, 1), (3, 2, 4), (5, 4, 12)]:
            gen = SpecGenerator(target, NoTokenizer(), untrained_head(target, arch, draft_vocab_size=40),
                                depth=depth, top_k=top_k, total_tokens=total)
            for seed in range(2):
                prompt = torch.randint(0, 96, (5 + seed,), generator=torch.Generator().manual_seed(seed))
                ref = target.generate(prompt[None], max_new_tokens=20, do_sample=False)
                problem = greedy_difference(target, gen.generate(prompt, max_new_tokens=20).sequences, ref)
                if problem:
                    failures.append(f"{arch} {(depth, top_k, total)} seed {seed}: {problem}")
    assert not failures, "\n".join(failures)


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
