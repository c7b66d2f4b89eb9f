"""The engine's parts: host syncs per cycle, padded static trees, verifiers, the KV buffer, tree attention."""

from __future__ import annotations

import warnings

import pytest
import torch

from griffin import DraftConfig, DraftModel, SpecGenerator
from griffin.backend import PackedGQA, TargetBackend
from griffin.drafters import OracleDrafter
from griffin.generator import GenerationStats
from griffin.kv_cache import BufferCache, cache_keyword, cached_forward
from griffin.sampling import SamplingConfig, sample
from griffin.tree import build_tree, chain
from griffin.verify import Greedy, TreeSampling, follow
from tests.conftest import tiny_model

# every way a tensor's value reaches Python; on a GPU each waits for the device
HOST_READS = ["item", "tolist", "cpu", "numpy", "nonzero", "unique", "masked_select", "__bool__", "__int__",
              "__float__", "__index__"]


class NoTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids.tolist())


def head(target, arch="griffin", draft_vocab_size=0, seed=0):
    torch.manual_seed(seed)
    return DraftModel(DraftConfig.from_target(target.config, arch=arch, draft_vocab_size=draft_vocab_size))


def steps(gen: SpecGenerator, prompt: torch.Tensor, max_new_tokens: int, eos=(), drafter=None, temperature=0.0,
          top_p=1.0, top_k=0):
    """The generation loop itself (one yield per cycle, the prefill's token first)."""
    sampling = SamplingConfig(temperature, top_p, top_k)
    generator = None if sampling.greedy else torch.Generator(device=gen.device).manual_seed(0)
    return gen._steps(prompt.to(gen.device), max_new_tokens, sampling, gen.eos_ids(list(eos)), generator,
                      GenerationStats(), drafter)


def syncs_per_cycle(gen: SpecGenerator, prompt: torch.Tensor, counter: list[int], **kwargs) -> list[int]:
    """Run the generation loop and count host reads between consecutive yields (the prefill first)."""
    per_cycle = []
    counter[0] = 0
    for _ in steps(gen, prompt, 24, **kwargs):
        per_cycle.append(counter[0])
        counter[0] = 0
    return per_cycle


@pytest.fixture
def counted(monkeypatch):
    """Count calls of every host read on tensors (and boolean-mask indexing, which needs nonzero on a GPU)."""
    counter = [0]

    def wrap(original):
        def counting(*args, **kwargs):
            counter[0] += 1
            return original(*args, **kwargs)

        return counting

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))
    for name in ("nonzero", "unique", "masked_select"):
        monkeypatch.setattr(torch, name, wrap(getattr(torch, name)))

    def by_mask(index) -> bool:
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0 for i in parts)

    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def counted_getitem(self, index):
        counter[0] += by_mask(index)
        return getitem(self, index)

    def counted_setitem(self, index, value):
        counter[0] += by_mask(index)
        return setitem(self, index, value)

    monkeypatch.setattr(torch.Tensor, "__getitem__", counted_getitem)
    monkeypatch.setattr(torch.Tensor, "__setitem__", counted_setitem)
    return counter


@pytest.mark.parametrize("arch,vocab,temperature,lookup", [("griffin", 40, 0.0, 0), ("eagle", 0, 0.0, 0),
                                                           ("griffin", 40, 1.0, 0), ("griffin", 40, 0.0, 5),
                                                           ("eagle", 0, 1.0, 5), ("eagle3", 40, 0.0, 0),
                                                           ("griffin3", 40, 1.0, 5)])
def test_one_host_sync_per_cycle(counted, arch, vocab, temperature, lookup):
    target = tiny_model("llama", vocab_size=96, layers=6 if arch.endswith("3") else 2)
    gen = SpecGenerator(target, NoTokenizer(), head(target, arch, vocab), depth=4, top_k=4, total_tokens=12,
                        lookup=lookup)
    gen.static_shapes = True  # what a GPU runs: on the CPU a chain is trimmed after reading it, which costs no sync
    prompt = torch.tensor([5, 17, 33, 2, 60, 71])
    per_cycle = syncs_per_cycle(gen, prompt, counted, temperature=temperature, top_p=0.9, top_k=20)
    assert len(per_cycle) > 3, per_cycle
    assert per_cycle == [1] * len(per_cycle), per_cycle


def test_one_host_sync_per_cycle_with_an_oracle_and_eos(counted):
    target = tiny_model("qwen2", vocab_size=96)
    gen = SpecGenerator(target, NoTokenizer(), head(target), depth=3, top_k=3, total_tokens=8)
    prompt = torch.tensor([5, 17, 33, 2])
    with torch.no_grad():
        ref = target.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, 4:].tolist()
    drafter = OracleDrafter(ref, depth=3, top_k=3, total_tokens=8, mode="tree", vocab_size=96)
    counted[0] = 0
    per_cycle, out = [], []
    for chunk in steps(gen, prompt, 24, eos=[ref[10]], drafter=drafter):
        per_cycle.append(counted[0])
        out += chunk.tolist()
        counted[0] = 0
    assert out == ref[: ref.index(ref[10]) + 1]
    assert per_cycle == [1] * len(per_cycle)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_host_sync_per_cycle_on_cuda(temperature):
    target = tiny_model("llama", vocab_size=96).cuda()
    gen = SpecGenerator(target, NoTokenizer(), head(target, "griffin", 40), depth=4, top_k=4, total_tokens=12)
    loop = steps(gen, torch.tensor([5, 17, 33, 2, 60]), 24, temperature=temperature, top_p=0.9, top_k=20)
    next(loop)  # the prefill and its first allocations
    per_cycle = []
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("warn")
        while True:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    next(loop)
                except StopIteration:
                    break
            per_cycle.append(sum("synchroniz" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(per_cycle) > 3 and max(per_cycle) <= 1, per_cycle


def test_trees_are_padded_to_a_static_size_and_padding_is_never_accepted():
    root = torch.tensor([7])
    # two candidates, asked for five nodes: three padding nodes (token 0)
    tree = build_tree(root, torch.tensor([3, 0]), torch.tensor([-0.1, -0.2]), torch.tensor([-1, 0]),
                      torch.tensor([1, 2]), total_tokens=5, max_depth=2)
    assert tree.size == 6 and tree.valid.tolist() == [True, True, True, False, False, False]
    assert tree.depths.tolist()[:3] == [0, 1, 2]
    # the target's choice after the root is 0, the padding nodes' token: still not accepted
    logits = torch.full((6, 10), -5.0)
    logits[0, 0] = 5.0
    acc = Greedy().accept(tree, logits)
    assert int(acc.length) == 0 and acc.bonus.tolist() == [0] and acc.path.tolist() == [0, 0, 0]
    logits[0] = -5.0
    logits[0, 3], logits[1, 0], logits[2, 4] = 5.0, 5.0, 5.0  # 3 then 0 (the real child) then bonus 4
    acc = Greedy().accept(tree, logits)
    assert int(acc.length) == 2 and acc.path.tolist() == [0, 1, 2] and acc.bonus.tolist() == [4]
    assert acc.emitted(tree).tolist() == [3, 0, 4]


def test_chain_proposals_and_follow():
    tree = chain(torch.tensor([9]), torch.tensor([4, 5]), size=4)
    assert tree.size == 5 and tree.max_depth == 4 and tree.valid.tolist() == [True, True, True, False, False]
    assert tree.ancestors[2].tolist() == [True, True, True, False, False]
    acc = follow(tree, torch.tensor([4, 5, 6, 0, 0]))
    assert int(acc.length) == 2 and acc.path.tolist()[:3] == [0, 1, 2] and acc.bonus.tolist() == [6]
    assert acc.emitted(tree).tolist()[:3] == [4, 5, 6]
    acc = follow(tree, torch.tensor([4, 1, 6, 0, 0]))  # the second token is rejected
    assert int(acc.length) == 1 and acc.bonus.tolist() == [1]


def test_tree_sampling_takes_the_first_child_in_draft_order_and_keeps_p():
    # root with children 2 (best draft score) and 1; p after the root: token 1 (0.3), 2 (0.5), 3 (0.2)
    tree = build_tree(torch.tensor([0]), torch.tensor([1, 2]), torch.tensor([-0.5, -0.1]), torch.tensor([-1, -1]),
                      torch.tensor([1, 1]), total_tokens=2, max_depth=1)
    logits = torch.full((3, 4), float("-inf"))
    logits[0, 1:] = torch.tensor([0.3, 0.5, 0.2]).log()
    logits[1:, 0] = 0.0  # after either child the target emits 0
    rule = TreeSampling(SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    runs = 4000
    counts = torch.zeros(4)
    for _ in range(runs):
        acc = rule.accept(tree, logits)
        first = acc.emitted(tree)[0]
        counts[first] += 1
        if int(acc.length):
            assert tree.tokens[acc.path[1]] == first and acc.bonus.tolist() == [0]
        else:
            assert first == 3  # the bonus is only ever a token no child carries
    share = counts / runs
    assert abs(share[1] - 0.3) < 0.03 and abs(share[2] - 0.5) < 0.03 and abs(share[3] - 0.2) < 0.03


def test_sample_is_multinomial_and_never_draws_zero_probability():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75], [0.5, 0.0, 0.5, 0.0]])
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([sample(probs, g) for _ in range(4000)])  # [runs, 2]
    assert set(draws[:, 0].tolist()) == {1, 3} and set(draws[:, 1].tolist()) == {0, 2}
    assert abs((draws[:, 0] == 3).float().mean() - 0.75) < 0.03
    assert abs((draws[:, 1] == 0).float().mean() - 0.5) < 0.03
    a = sample(probs, torch.Generator().manual_seed(5))
    assert torch.equal(a, sample(probs, torch.Generator().manual_seed(5)))


def test_kv_buffer_is_one_tensor_compacted_by_one_index_copy_and_reused():
    target = tiny_model("llama", vocab_size=64)
    backend = TargetBackend(target)
    cache = backend.prepare(40)
    backend.prefill(torch.arange(10))
    assert len(cache.buffers) == 1 and cache.buffers[0].shape[:2] == (2, 2)  # [layers, k/v, ...]
    tree = chain(torch.tensor([11]), torch.tensor([12, 13, 14]))
    backend.forward(tree.tokens, 10 + tree.depths, tree.ancestors)
    before = cache.buffers[0][..., [10, 12], :].clone()
    cache.keep(10, torch.tensor([10, 12]))
    assert cache.length == 12 and torch.equal(cache.buffers[0][..., 10:12, :], before)
    buffer = cache.buffers[0]
    again = backend.prepare(30)  # fits: the same buffer, emptied
    assert again is cache and again.length == 0
    backend.prefill(torch.arange(5))
    assert cache.buffers[0] is buffer
    backend.prepare(4000)
    backend.prefill(torch.arange(5))
    assert cache.buffers[0].shape[-2] >= 4000


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_gqa_tree_attention_equals_eager(family):
    target = tiny_model(family, vocab_size=64)  # 4 query heads on 2 KV heads
    tree = build_tree(torch.tensor([1]), torch.tensor([5, 6, 7, 8]), torch.tensor([-0.1, -0.2, -0.3, -0.4]),
                      torch.tensor([-1, -1, 0, 1]), torch.tensor([1, 1, 2, 2]), total_tokens=4, max_depth=2)
    results = {}
    for impl in ("sdpa", "eager"):
        target.config._attn_implementation = impl
        backend = TargetBackend(target, weight_major_rows=0)
        backend.prepare(32)
        backend.prefill(torch.arange(12) + 3)
        hidden, logits = backend.forward(tree.tokens, 12 + tree.depths, tree.ancestors)
        results[impl] = logits
        if impl == "sdpa":
            assert isinstance(backend.packed_gqa, PackedGQA) and backend.packed_gqa.config is not None
    target.config._attn_implementation = "sdpa"
    torch.testing.assert_close(results["sdpa"], results["eager"], rtol=1e-4, atol=1e-4)


def test_buffer_cache_serves_layers_of_other_shapes():
    cache = BufferCache(num_layers=2, max_len=8)
    k0 = torch.randn(1, 2, 3, 4)
    cache.update(k0, k0 + 1, 0)
    k1, v1 = torch.randn(1, 1, 3, 6), torch.randn(1, 1, 3, 5)  # another head count, keys and values differ
    keys, values = cache.update(k1, v1, 1)
    assert torch.equal(keys, k1) and torch.equal(values, v1) and len(cache.buffers) == 3
    cache.keep(1, torch.tensor([2]))
    assert cache.length == 2 and torch.equal(cache.layers[1].keys[:, :, 1], k1[:, :, 2])
    assert torch.equal(cache.layers[0].values[:, :, 1], k0[:, :, 2] + 1)


def test_cached_forward_names_the_cache_as_this_transformers_does_and_decodes_as_one_forward():
    target = tiny_model()
    decoder, ids = target.get_decoder(), torch.arange(1, 8)[None]
    cache = BufferCache(target.config.num_hidden_layers, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecated keyword would warn on every call
        first = cached_forward(decoder, cache, input_ids=ids[:, :5], position_ids=torch.arange(5)[None])
        rest = cached_forward(decoder, cache, input_ids=ids[:, 5:], position_ids=torch.arange(5, 7)[None])
    whole = decoder(input_ids=ids, use_cache=False).last_hidden_state
    assert torch.allclose(torch.cat((first.last_hidden_state, rest.last_hidden_state), 1), whole, atol=1e-5)
    assert cache.length == 7

    class Older(torch.nn.Module):  # a transformers 5.x from before the rename
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            return past_key_values

    assert cached_forward(Older(), cache, input_ids=ids) is cache and cache_keyword(Older) == "past_key_values"


def test_interleaved_generations_do_not_share_buffers():
    target = tiny_model("llama", vocab_size=96, seed=2)
    gen = SpecGenerator(target, NoTokenizer(), head(target), depth=3, top_k=3, total_tokens=8)
    prompts = [torch.tensor([5, 17, 33]), torch.tensor([60, 2, 71, 8, 9])]
    refs = [target.generate(p[None], max_new_tokens=20, do_sample=False)[0, len(p):].tolist() for p in prompts]
    runs = [steps(gen, p, 20) for p in prompts]
    outs: list[list[int]] = [[], []]
    live = [0, 1]
    while live:
        for i in list(live):  # one cycle of each in turn
            try:
                outs[i] += next(runs[i]).tolist()
            except StopIteration:
                live.remove(i)
    assert outs == refs
    assert gen.generate(prompts[0], max_new_tokens=20).sequences[0, 3:].tolist() == refs[0]  # shared again
    assert not gen._busy


def test_compiled_static_verification_traces_whole_and_keeps_the_output():
    target = tiny_model("llama", vocab_size=96)
    # backend="eager": dynamo traces the static pass (fullgraph: no graph break) without generating code
    gen = SpecGenerator(target, NoTokenizer(), head(target), depth=3, top_k=3, total_tokens=8,
                        compile={"backend": "eager", "fullgraph": True})
    prompt = torch.tensor([5, 17, 33, 2, 60])
    ref = target.generate(prompt[None], max_new_tokens=16, do_sample=False)
    out = gen.generate(prompt, max_new_tokens=16)
    assert torch.equal(out.sequences, ref) and out.stats.cycles > 3
    assert gen.backend.cache.max_len >= 1024 and gen.backend.cache.length == 5 + 16 - 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_verification_keeps_the_output(dtype):
    target = tiny_model("llama", vocab_size=96).to("cuda", dtype)
    gen = SpecGenerator(target, NoTokenizer(), head(target), depth=4, top_k=4, total_tokens=12,
                        compile="reduce-overhead")
    eager = SpecGenerator(target, NoTokenizer(), head(target), depth=4, top_k=4, total_tokens=12)
    for seed in range(3):
        prompt = torch.randint(0, 96, (6 + seed,), generator=torch.Generator().manual_seed(seed)).cuda()
        ref = target.generate(prompt[None], max_new_tokens=32, do_sample=False)
        assert torch.equal(eager.generate(prompt, max_new_tokens=32).sequences, ref)
        assert torch.equal(gen.generate(prompt, max_new_tokens=32).sequences, ref)


def test_small_verification_passes_run_weight_major_on_cpu(monkeypatch):
    import torch.nn.functional as F

    target = tiny_model("llama", vocab_size=64)
    backend = TargetBackend(target)  # CPU: weight-major up to 8 rows by default
    backend.prepare(64)
    backend.prefill(torch.arange(10))
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    for size, linear_calls in ((3, 0), (11, 2 * 7 + 1)):  # all q, k, v, o, gate, up, down and the LM head
        calls.clear()
        tree = chain(torch.tensor([1]), torch.arange(2, 2 + size))
        backend.forward(tree.tokens, 10 + tree.depths, tree.ancestors)
        backend.cache.crop(10)
        assert len(calls) == linear_calls, size
