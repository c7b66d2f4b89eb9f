"""Target families: sliding-window attention and logits steps are reproduced exactly, anything else is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from griffin import SpecGenerator
from griffin.drafters import OracleDrafter
from griffin.family import UnsupportedTarget, attention_windows, check_target, logits_transform, output_logits
from griffin.plain import plain_generate
from griffin.sampling import SamplingConfig
from tests.conftest import tiny_model
from tests.test_generation import NoTokenizer, untrained_head

WINDOW = 6
# name -> (transformers family, config fields): every kind of mask and logits step the package accepts
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "gemma2": ("gemma2", {"sliding_window": WINDOW, "final_logit_softcapping": 4.0}),
    "gemma3": ("gemma3_text", {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                               "final_logit_softcapping": 4.0}),
    "granite": ("granite", {"logits_scaling": 4.0}),
    "cohere": ("cohere", {"logit_scale": 0.25}),
}
WINDOWED = {"mistral-window", "qwen2-window", "gemma2", "gemma3"}
TRANSFORMED = {"gemma2", "gemma3", "granite", "cohere"}


def family_model(name: str, seed: int = 0):
    family, config = FAMILIES[name]
    return tiny_model(family, vocab_size=96, seed=seed, **config)


@pytest.mark.parametrize("name", FAMILIES)
def test_output_logits_equal_the_models_own_forward(name):
    model = family_model(name)
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        want = model(input_ids=ids).logits
        torch.testing.assert_close(output_logits(model, hidden), want, rtol=1e-5, atol=1e-5)
        rows = torch.tensor([3, 50, 7])  # training computes soft labels from a subset of the lm_head rows
        subset = logits_transform(model.config)(hidden @ model.lm_head.weight[rows].T)
        torch.testing.assert_close(subset, want[..., rows], rtol=1e-5, atol=1e-5)
        plain = model.lm_head(hidden)
    assert (name in TRANSFORMED) == (not torch.allclose(plain, want, atol=1e-3))
    windows = attention_windows(model.config)
    assert (name in WINDOWED) == (WINDOW in windows)
    check_target(model)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_identical_to_generate_past_the_window(name):
    model = family_model(name)
    for depth, top_k, total in ((5, 8, 24), (3, 4, 7)):
        gen = SpecGenerator(model, NoTokenizer(), untrained_head(model), depth=depth, top_k=top_k, total_tokens=total)
        for seed, length in ((0, 4), (1, 9)):  # prompts shorter and longer than the window
            prompt = torch.randint(0, 96, (length,), generator=torch.Generator().manual_seed(seed))
            ref = model.generate(prompt[None], max_new_tokens=24, do_sample=False)
            assert torch.equal(gen.generate(prompt, max_new_tokens=24).sequences, ref), (name, depth, seed)
            # long accepted paths: whole branches of 5 drafted tokens cross the window's edge
            oracle = OracleDrafter(ref[0, length:].tolist(), depth=depth, top_k=top_k, total_tokens=total,
                                   mode="tree", vocab_size=96)
            assert torch.equal(gen.generate(prompt, max_new_tokens=24, drafter=oracle).sequences, ref)
            if depth == 5:  # griffin's plain decoding loop (the demo's other baseline) too
                plain = plain_generate(model, prompt, 24, SamplingConfig(), torch.tensor([], dtype=torch.long))
                assert torch.equal(plain, ref[0, length:])


def test_the_check_catches_an_ignored_window_or_logits_step(monkeypatch):
    import griffin.family as family

    model = family_model("mistral-window")
    monkeypatch.setattr(family, "attention_windows", lambda config: [None] * config.num_hidden_layers)
    with pytest.raises(UnsupportedTarget, match="mistral: tree verification does not reproduce"):
        check_target(model)
    monkeypatch.undo()
    model = family_model("granite")
    monkeypatch.setattr(family, "logits_transform", lambda config: lambda logits: logits)
    with pytest.raises(UnsupportedTarget, match="granite: tree verification does not reproduce"):
        check_target(model)


class ScaledLlama(LlamaForCausalLM):
    """A family with a logits step griffin does not know."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_unsupported_targets_are_refused_with_the_family_and_the_reason():
    model = ScaledLlama(tiny_model("llama", vocab_size=96).config).eval()
    gen = SpecGenerator(model, NoTokenizer(), untrained_head(model))
    with pytest.raises(UnsupportedTarget, match="llama: tree verification does not reproduce the model's own logits"):
        gen.generate([1, 2, 3], max_new_tokens=4)
    model = tiny_model("llama", vocab_size=96)
    model.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(UnsupportedTarget, match=r"llama: layers of type \['chunked_attention'\]"):
        check_target(model)
    model = tiny_model("qwen2", vocab_size=96)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(UnsupportedTarget, match="qwen2: attention implementation 'flex_attention' ignores the tree"):
        SpecGenerator.from_pretrained(model, untrained_head(model), tokenizer=NoTokenizer(), total_tokens=4)
    model = tiny_model("gemma3_text", vocab_size=96, use_bidirectional_attention=True)
    with pytest.raises(UnsupportedTarget, match="gemma3_text: this configuration attends bidirectionally"):
        check_target(model)
