"""Classic speculative sampling with a standalone draft LM: exactly the target's output (greedy tokens against
transformers' generate, the sampling distribution by chi-square), chains, reduced draft vocabularies, γ tuning."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from griffin import SpecGenerator
from griffin.autotune import expected_tokens, measured_alpha
from griffin.compat import TokenizerMismatch
from griffin.draft_lm import DraftLM, build_student, save_draft_lm
from griffin.sampling import SamplingConfig
from tests.conftest import pooled_chisquare, tiny_model
from tests.test_generation import PROMPTS, NoTokenizer, exact_sequences


def lm_generator(target, draft, gamma: int, vocab: torch.Tensor | None = None) -> SpecGenerator:
    return SpecGenerator(target, NoTokenizer(), DraftLM(draft, vocab, target.config.vocab_size), gamma=gamma)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_identical_on_tiny_targets_over_chain_lengths(family):
    target = tiny_model(family, vocab_size=96)
    draft = tiny_model(family, vocab_size=96, seed=1, hidden=32, layers=1)
    reduced = torch.arange(0, 96, 3)  # the draft can propose a third of the tokens only
    for gamma, vocab in itertools.product((1, 2, 3, 6), (None, reduced)):
        gen = lm_generator(target, draft, gamma, vocab)
        for seed in range(2):
            prompt = torch.randint(0, 96, (5 + seed,), generator=torch.Generator().manual_seed(seed))
            ref = target.generate(prompt[None], max_new_tokens=20, do_sample=False)
            out = gen.generate(prompt, max_new_tokens=20)
            assert torch.equal(out.sequences, ref), (gamma, vocab is None, seed)
            assert max(out.stats.accepted_hist) <= gamma + 1
    # logits padded wider than the target's (as Qwen2.5 sizes differ): the draft proposes only ids the target has
    wide = tiny_model(family, vocab_size=112, seed=2, hidden=32, layers=1)
    gen = lm_generator(target, wide, gamma=3)
    assert gen.draft.vocab.tolist() == list(range(96))
    prompt = torch.tensor([3, 1, 4, 1, 5])
    for temperature in (0.0, 1.0):
        ref = target.generate(prompt[None], max_new_tokens=20, do_sample=False)
        out = gen.generate(prompt, max_new_tokens=20, temperature=temperature, seed=0)
        assert out.sequences.max() < 96 and (temperature or torch.equal(out.sequences, ref))


def test_a_draft_equal_to_the_target_is_accepted_whole_and_eos_and_budget_cut_chains():
    target = tiny_model("llama", vocab_size=96, seed=3)
    gen = lm_generator(target, target, gamma=4)
    prompt = torch.tensor([5, 17, 33, 2])
    full = target.generate(prompt[None], max_new_tokens=40, do_sample=False)
    out = gen.generate(prompt, max_new_tokens=40)
    assert torch.equal(out.sequences, full)
    assert out.stats.accepted_hist == {5: 7, 4: 1}  # 1 prefill token + 7 full chains of 4 + 1 bonus, then the budget
    new = full[0, 4:].tolist()
    first_seen = {}
    for i, tok in enumerate(new):
        first_seen.setdefault(tok, i)
    eos, pos = next((t, i) for t, i in first_seen.items() if i >= 7)
    ref = target.generate(prompt[None], max_new_tokens=40, do_sample=False, eos_token_id=eos)
    cut = gen.generate(prompt, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(cut.sequences, ref) and cut.stats.new_tokens == pos + 1
    for budget in range(1, 12):
        ref = target.generate(prompt[None], max_new_tokens=budget, do_sample=False)
        assert torch.equal(gen.generate(prompt, max_new_tokens=budget).sequences, ref), budget


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.8, 0.9, 3)])
def test_sampling_matches_the_target_distribution(temperature, top_p, top_k):
    target = tiny_model("llama", vocab_size=5, hidden=16, layers=1, seed=11)
    draft = tiny_model("llama", vocab_size=5, hidden=16, layers=1, seed=12)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # spread-out distributions
        draft.lm_head.weight.mul_(0.25)
    gen = lm_generator(target, draft, gamma=2, vocab=torch.tensor([0, 1, 3]))  # q = 0 on tokens 2 and 4
    prompt = torch.tensor([1, 3, 0])
    cfg = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
    exact = exact_sequences(target, prompt, cfg, length=3)
    runs, counts, accepted = 1000, {}, 0
    for seed in range(runs):
        out = gen.generate(prompt, max_new_tokens=3, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        key = tuple(out.sequences[0, 3:].tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += out.stats.cycles == 1  # both drafted tokens accepted
    assert all(exact.get(k, 0) > 0 for k in counts), "sampled a sequence the target cannot produce"
    assert pooled_chisquare(counts, exact, runs)[0] > 0.001
    assert accepted > runs // 20


def test_seeded_sampling_is_reproducible():
    target = tiny_model("qwen2", vocab_size=50)
    gen = lm_generator(target, tiny_model("qwen2", vocab_size=50, seed=4, hidden=32, layers=1), gamma=3)
    a = gen.generate([1, 2, 3], max_new_tokens=20, temperature=0.8, top_k=10, seed=7)
    b = gen.generate([1, 2, 3], max_new_tokens=20, temperature=0.8, top_k=10, seed=7)
    assert torch.equal(a.sequences, b.sequences)


def test_expected_tokens_and_measured_alpha():
    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == 5
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    # γ = 2: 3 cycles fully accepted (2 each), 1 cycle with one accepted then a rejection, 2 cycles rejected at once
    assert measured_alpha({3: 3, 2: 1, 1: 2}, gamma=2) == 7 / 10


@pytest.fixture(scope="module")
def student_dir(embedded, tmp_path_factory):
    model, tokenizer = embedded
    folder = tmp_path_factory.mktemp("student")
    vocab = torch.cat((torch.arange(4096), torch.tensor([49000])))
    save_draft_lm(build_student(model, 2), folder, vocab, tokenizer)
    return folder


def test_greedy_identical_on_embedded_target_with_an_untrained_student(embedded, student_dir):
    model, tokenizer = embedded
    for gamma in (1, 4):
        gen = SpecGenerator.from_pretrained(model, tokenizer=tokenizer, draft_model=student_dir, gamma=gamma)
        assert gen.draft.vocab.shape[0] == 4097 and gen.draft.model.config.num_hidden_layers == 2
        for prompt in PROMPTS[gamma : gamma + 2]:
            ids = gen.encode([{"role": "user", "content": prompt}])
            ours = gen.generate(ids, max_new_tokens=16)
            ref = model.generate(ids[None], max_new_tokens=16, do_sample=False)
            assert torch.equal(ours.sequences, ref), (gamma, prompt)


def test_an_incompatible_draft_folder_is_refused(embedded, tmp_path):
    model, tokenizer = embedded
    other = tiny_model("llama", vocab_size=len(tokenizer), hidden=16, layers=1)
    from tests.test_compat import edited_copy

    def swap(data):
        vocab = data["model"]["vocab"]
        vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]

    save_draft_lm(other, tmp_path, tokenizer=edited_copy(tokenizer, swap))
    with pytest.raises(TokenizerMismatch, match="vocabulary differs: id .* is '(hello|world)'"):
        SpecGenerator.from_pretrained(model, tokenizer=tokenizer, draft_model=tmp_path, gamma=2)


def test_gamma_auto_is_chosen_from_measured_costs_and_cached(tiny_target_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path / "cache"))
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    save_draft_lm(build_student(target, 1), tmp_path / "student", torch.arange(500),
                  AutoTokenizer.from_pretrained(tiny_target_dir))
    gen = SpecGenerator.from_pretrained(str(tiny_target_dir), draft_model=tmp_path / "student", gamma="auto")
    tuned = list((tmp_path / "cache" / "autotune").glob("draft-lm-*.json"))
    assert len(tuned) == 1
    choice = json.loads(tuned[0].read_text())
    assert 1 <= gen.gamma == choice["gamma"] <= 8 and 0 <= choice["alpha"] <= 1
    best = max(choice["candidates"], key=lambda row: row["speedup"])
    assert best["gamma"] == gen.gamma and len(choice["candidates"]) == 8
    again = SpecGenerator.from_pretrained(str(tiny_target_dir), draft_model=tmp_path / "student", gamma="auto")
    assert again.gamma == gen.gamma and len(list((tmp_path / "cache" / "autotune").iterdir())) == 1
    again.generate("hello", max_new_tokens=4, temperature=0.7, seed=0)  # sampling: its own gamma, tuned once
    sampled = [json.loads(p.read_text()) for p in (tmp_path / "cache" / "autotune").iterdir()]
    assert sorted(c["temperature"] for c in sampled) == [0.0, 0.7]
    assert again.gamma == next(c["gamma"] for c in sampled if c["temperature"] == 0.7)
    again.generate("hello", max_new_tokens=4)
    assert again.gamma == gen.gamma and len(list((tmp_path / "cache" / "autotune").iterdir())) == 2


def test_a_loaded_draft_model_takes_its_tokenizer_as_an_argument(tiny_target_dir, smol_tokenizer):
    """Like transformers' assistant_tokenizer=: a draft LM built in memory has no folder to find a tokenizer in."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    student = build_student(target, 1)  # in memory: no folder, no tokenizer
    with pytest.raises(ValueError, match="pass draft_tokenizer="):
        SpecGenerator.from_pretrained(target, tokenizer=smol_tokenizer, draft_model=student, gamma=2)
    gen = SpecGenerator.from_pretrained(target, tokenizer=smol_tokenizer, draft_model=student, gamma=2,
                                        draft_tokenizer=smol_tokenizer)
    prompt = torch.tensor([5, 17, 33, 2])
    ref = target.generate(prompt[None], max_new_tokens=12, do_sample=False)
    assert torch.equal(gen.generate(prompt, max_new_tokens=12).sequences, ref)
    with pytest.raises(ValueError, match="draft_tokenizer goes with a loaded draft_model"):
        SpecGenerator.from_pretrained(target, tokenizer=smol_tokenizer, draft_tokenizer=smol_tokenizer)
