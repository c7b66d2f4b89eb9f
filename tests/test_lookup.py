"""Prompt lookup added to a head's tree: the chain found in the context, grafted without duplicate siblings,
lossless, and long acceptances where the text repeats."""

from __future__ import annotations

import json

import pytest
import torch

from griffin import DraftConfig, DraftModel, SpecGenerator, autotune
from griffin.autotune import cut_tree_yield
from griffin.drafters import Context, PromptLookup, lookup_ngrams
from griffin.tree import Tree, build_tree, graft
from griffin.verify import Greedy, follow
from inference import speed
from tests.conftest import tiny_model
from tests.test_engine import NoTokenizer
from tests.test_inference import CharTokenizer


def small_tree() -> object:
    """root 9 -> {1 -> {3, 4}, 2}: candidates by level, parents as candidate indices."""
    t = torch.tensor
    return build_tree(t([9]), t([1, 2, 3, 4]), t([-0.1, -0.2, -0.3, -0.4]), t([-1, -1, 0, 0]), t([1, 1, 2, 2]), 4)


def test_graft_hangs_the_chain_below_the_node_that_spells_its_start():
    tree = small_tree()
    grafted = graft(tree, torch.tensor([1, 3, 7, 8]), torch.ones(4, dtype=torch.bool))
    assert grafted.size == 9 and grafted.max_depth == 4
    # chain tokens 1 and 3 are nodes 1 and 3 already: padding; 7 hangs from node 3, 8 from 7
    assert grafted.valid.tolist() == [True] * 5 + [False, False, True, True]
    assert grafted.parents[7:].tolist() == [3, 7]
    assert grafted.depths[7:].tolist() == [3, 4]
    assert grafted.ancestors[8].nonzero().flatten().tolist() == [0, 1, 3, 7, 8]
    # the target agrees with the whole chain: all four tokens are accepted, then the bonus
    choice = torch.zeros(9, dtype=torch.long)
    choice[0], choice[1], choice[3], choice[7], choice[8] = 1, 3, 7, 8, 5
    acceptance = follow(grafted, choice)
    assert int(acceptance.length) == 4
    assert acceptance.emitted(grafted).tolist() == [1, 3, 7, 8, 5]


def test_graft_from_the_root_and_without_a_match():
    tree = small_tree()
    fresh = graft(tree, torch.tensor([6, 1, 3]), torch.ones(3, dtype=torch.bool))
    assert fresh.parents[5:].tolist() == [0, 5, 6] and fresh.valid[5:].all()
    none = graft(tree, torch.tensor([6, 1, 3]), torch.zeros(3, dtype=torch.bool))
    assert not none.valid[5:].any()
    choice = torch.tensor([6, 0, 0, 0, 0, 1, 3, 0])
    assert int(follow(none, choice).length) == 0  # padding is never entered
    assert int(follow(fresh, choice).length) == 3


def test_lookup_copies_what_followed_the_latest_occurrence_of_the_longest_ngram():
    context = Context(capacity=4)  # grows past its capacity
    context.reset(torch.tensor([5, 6, 7, 1, 6, 7, 2, 9, 5, 6, 7]))
    tokens, valid = context.lookup(3, [3, 2, 1])
    # "5 6 7" occurs at 0: its successors 1 6 7 beat the later bigram "6 7" at 4 (-> 2 9 5)
    assert tokens.tolist() == [1, 6, 7] and valid.all()
    context.reset(torch.tensor([4, 8, 3]))
    context.append(torch.tensor([8]))
    tokens, valid = context.lookup(3, [3, 2, 1])  # only the unigram 8 matches; one token follows it before the end
    assert tokens[:2].tolist() == [3, 8] and valid.tolist() == [True, True, False]
    assert not context.lookup(3, [3, 2])[1].any()  # no bigram repeats
    context.reset(torch.tensor([1, 2, 3]))
    assert not context.lookup(3, [3, 2, 1])[1].any()


def generator(lookup: int) -> SpecGenerator:
    target = tiny_model("llama", vocab_size=96, seed=3)
    torch.manual_seed(0)
    draft = DraftModel(DraftConfig.from_target(target.config, arch="griffin"))
    return SpecGenerator(target, NoTokenizer(), draft, depth=3, top_k=3, total_tokens=6, lookup=lookup)


def test_lookup_keeps_the_target_output_and_accepts_more_on_repeating_text():
    plain, looked = generator(0), generator(8)
    prompt = torch.tensor([5, 17, 33, 2, 60, 71, 8, 12] * 3)
    with torch.no_grad():
        ref = plain.target.generate(prompt[None], max_new_tokens=40, do_sample=False)[0, prompt.shape[0]:]
    a = plain.generate(prompt, max_new_tokens=40, eos_token_id=[])
    b = looked.generate(prompt, max_new_tokens=40, eos_token_id=[])
    assert torch.equal(a.sequences[0, prompt.shape[0]:], ref) and torch.equal(b.sequences, a.sequences)
    assert b.stats.tau > a.stats.tau + 0.5, (a.stats.tau, b.stats.tau)
    sampled = [g.generate(prompt, max_new_tokens=20, temperature=0.8, seed=1, eos_token_id=[]) for g in (plain, looked)]
    assert all(s.sequences.shape[1] == prompt.shape[0] + 20 for s in sampled)


@pytest.mark.parametrize("value", [-1, 1.5, True, "4"])
def test_lookup_must_be_a_nonnegative_integer(value):
    with pytest.raises(ValueError, match="lookup must be an integer"):
        generator(value)


def test_greedy_verifier_is_kept():
    assert isinstance(generator(4).make_drafter(64).verifier(type("S", (), {"greedy": True})(), None), Greedy)


def test_cut_tree_yield_keeps_the_chain_and_the_path_it_spells_in_every_cut_tree():
    grafted = graft(small_tree(), torch.tensor([1, 3, 7, 8]), torch.ones(4, dtype=torch.bool))
    trace = [(grafted, torch.tensor([0, 1, 3, 7, 8]))]  # the target took the whole chain: 4 tokens + the bonus
    assert cut_tree_yield(trace, total=4, depth=8) == (5, 7)  # the root, 4 head nodes, 2 chain nodes (not padding)
    # a one-node head tree keeps node 1; node 3 (the head's 3rd best) stays because the chain spells it
    assert cut_tree_yield(trace, total=1, depth=1) == (5, 5)
    assert cut_tree_yield([(grafted, torch.tensor([0, 2]))], total=1, depth=8)[0] == 1  # node 2: the head's, cut
    # a trimmed proposal (the chain's padding dropped) is the same tree to the tuner
    assert cut_tree_yield([(grafted.compact(), torch.tensor([0, 1, 3, 5, 6]))], total=1, depth=1) == (5, 5)
    assert cut_tree_yield([(small_tree(), torch.tensor([0, 1, 3]))], total=4, depth=8) == (3, 5)  # no chain


def test_compact_drops_padding_and_renumbers_the_tree():
    grafted = graft(small_tree(), torch.tensor([1, 3, 7, 8]), torch.ones(4, dtype=torch.bool))
    tree = grafted.compact()
    assert tree.valid is None and tree.grafted == 2 and tree.max_depth == grafted.max_depth
    assert tree.tokens.tolist() == [9, 1, 2, 3, 4, 7, 8]
    assert tree.parents.tolist() == [0, 0, 0, 1, 1, 3, 5]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3, 4]
    assert tree.ancestors[6].nonzero().flatten().tolist() == [0, 1, 3, 5, 6]
    assert tree.draft_order.tolist() == [0, 1, 2, 3, 4, 5, 6]
    choice = torch.zeros(7, dtype=torch.long)
    choice[0], choice[1], choice[3], choice[5], choice[6] = 1, 3, 7, 8, 5
    assert follow(tree, choice).emitted(tree).tolist() == [1, 3, 7, 8, 5]  # what the padded tree accepts
    unpadded = small_tree()
    assert unpadded.compact() is unpadded
    assert graft(unpadded, torch.tensor([6]), torch.zeros(1, dtype=torch.bool)).compact().size == 5  # no match


def test_a_trimmed_chain_verifies_only_its_real_tokens_and_matches_the_static_one():
    target = tiny_model("llama", vocab_size=64)
    torch.manual_seed(0)
    head = DraftModel(DraftConfig.from_target(target.config))
    prompt = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6])
    outputs, sizes = {}, {}
    for static in (True, False):
        gen = SpecGenerator(target, NoTokenizer(), head, depth=3, top_k=4, total_tokens=4, lookup=6)
        assert not gen.static_shapes  # on the CPU
        gen.static_shapes = static
        forward, seen = gen.backend.forward, []

        def counting(tokens, *args, _forward=forward, _seen=seen, **kwargs):
            _seen.append(tokens.shape[0])
            return _forward(tokens, *args, **kwargs)

        gen.backend.forward = counting
        outputs[static] = gen.generate(prompt, max_new_tokens=24).sequences
        sizes[static] = seen
    assert torch.equal(outputs[True], outputs[False])
    assert set(sizes[True]) == {1 + 4 + 6}  # static: every cycle verifies the whole chain
    assert max(sizes[False]) <= 1 + 4 + 6 and min(sizes[False]) < 1 + 4 + 6  # trimmed: a chain's padding is not


def test_the_tree_is_tuned_with_the_chain_and_apart_from_the_tree_without_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GRIFFIN_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "BUDGET_S", 3.0)
    assert autotune.interpolate({1: 1.0, 5: 3.0, 9: 3.0}, 3) == 2.0 and autotune.interpolate({1: 1.0, 5: 3.0}, 7) == 3.0
    target = tiny_model("llama", vocab_size=64)
    torch.manual_seed(0)
    head = DraftModel(DraftConfig.from_target(target.config))
    gen = SpecGenerator.from_pretrained(target, head, tokenizer=CharTokenizer(), total_tokens="auto", lookup=4)
    [record] = (tmp_path / "autotune").glob("*.json")
    choice = json.loads(record.read_text())
    assert gen.lookup == 4 and gen.total_tokens == choice["total_tokens"]
    off = (choice["depth"], choice["total_tokens"]) == autotune.PLAIN  # the plain loop: the chain is off too
    assert choice["lookup"] == (0 if off else 4) and gen.plain == off
    assert {n + 1 + 4 for n in autotune.TOTALS[::3]} <= set(map(int, choice["forward_cost_s"]))  # the chain's rows
    plain = SpecGenerator.from_pretrained(target, head, tokenizer=CharTokenizer(), total_tokens="auto")
    assert plain.lookup == 0 and len(list((tmp_path / "autotune").glob("*.json"))) == 2  # tuned apart
    # another process tuning the same band rewrites the cache: a run reports the choice its generator took
    record.write_text(json.dumps(choice | {"reason": "another process's choice"}))
    assert gen.tunings[0.0]["reason"] == choice["reason"] == speed.tuning_summary(gen, 0.0)["reason"]


def test_batched_grafted_trees_follow_as_each_row_alone():
    """Rows with and without a chain, grafted onto a batch of trees at once, equal each row grafted alone, and
    :func:`griffin.batch.follow_rows` takes each row's path as :func:`griffin.verify.follow` takes it alone, never
    entering a padding node."""
    from dataclasses import fields

    from griffin.batch import follow_rows

    tree = small_tree()
    stacked = Tree(*(torch.stack([getattr(tree, f.name)] * 3) if isinstance(getattr(tree, f.name), torch.Tensor)
                     else getattr(tree, f.name) for f in fields(Tree)))
    chains, valid = torch.tensor([6, 1, 3]).repeat(3, 1), torch.tensor([[False] * 3, [True] * 3, [False] * 3])
    batch = graft(stacked, chains, valid)
    rows = [graft(tree, chains[b], valid[b]) for b in range(3)]
    for b, alone in enumerate(rows):
        for f in ("tokens", "parents", "depths", "ancestors", "draft_order", "valid"):
            assert torch.equal(getattr(batch, f)[b], getattr(alone, f)), f
    choice = torch.tensor([6, 0, 0, 0, 0, 1, 3, 0]).repeat(3, 1)
    path, length, bonus = follow_rows(batch, choice)
    assert length.tolist() == [0, 3, 0] and bonus.tolist() == [6, 0, 6]
    for b, alone in enumerate(rows):
        acceptance = follow(alone, choice[b])
        assert int(acceptance.length) == int(length[b])
        assert path[b, : int(length[b]) + 1].tolist() == acceptance.path[: int(length[b]) + 1].tolist()


@pytest.mark.parametrize("tokens,ngrams", [(0, None), (3, ()), (3, (2, 0))])
def test_lookup_settings_are_checked_for_one_row_and_batches(tokens, ngrams):
    from griffin.batch import BatchPromptLookup
    from griffin.drafters import NoDraft

    for build in (PromptLookup, BatchPromptLookup):
        with pytest.raises(ValueError, match="prompt lookup needs tokens >= 1 and n-gram sizes >= 1"):
            build(NoDraft(), tokens, 16, ngrams)
    assert lookup_ngrams(3, None, trim=True) == [3, 2] and lookup_ngrams(3, (1, 3, 3), trim=False) == [3, 1]
