"""Drafting: every tree node is drafted from its own branch, cycle after cycle (a reference runs the head step by step).

Lossless tests stay green whatever the drafter proposes, so a drafting bug (a position off by one, a stale cache entry,
the wrong feature fed back) only shows as fewer accepted tokens. Here each drafted tree is rebuilt from scratch: the
head runs along the context and each node's branch with plain causal attention, one position at a time, and EAGLE-2's
selection is applied to those log-probabilities; the engine's tree must be the same tree with the same ranking.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from griffin import DraftConfig, DraftModel, SpecGenerator
from griffin.generator import GenerationStats
from griffin.sampling import SamplingConfig
from tests.conftest import tiny_model
from tests.test_generation import NoTokenizer


def sharp_head(target, arch: str, seed: int = 0) -> DraftModel:
    """An untrained head whose attention is sharp, so that positions and context entries change its output."""
    torch.manual_seed(seed)
    head = DraftModel(DraftConfig.from_target(target.config, arch=arch))
    with torch.no_grad():
        attn = head.layer.self_attn
        attn.q_proj.weight.mul_(30)
        attn.k_proj.weight.mul_(30)
        attn.v_proj.weight.mul_(8)
        attn.o_proj.weight.mul_(8)
    return head.eval()


class BranchReference:
    """The head's output after a branch, computed without the engine's cache or tree mask."""

    def __init__(self, head: DraftModel, ids: torch.Tensor, hidden: torch.Tensor, root: torch.Tensor):
        self.head, self.memo = head, {}
        self.ids, self.hidden, self.root = ids, hidden, root  # context [n], its target features [n, H], root [1]
        self.frontiers: list[list[tuple[int, ...]]] = []  # the branches expanded at each level, in expansion order

    @torch.no_grad()
    def predict(self, branch: tuple[int, ...]) -> torch.Tensor:
        """[H] the head's predict feature at the last token of root + ``branch`` (its draft logits come from it)."""
        if branch not in self.memo:
            tokens = torch.cat((self.ids[1:], self.root, torch.tensor(branch, dtype=torch.long)))
            features = self.hidden  # position t reads (features[t], tokens[t]); the root is read at position n-1
            for j in range(len(branch) + 1):
                t = features.shape[0]
                out = self.head(tokens[None, :t], features[None], torch.arange(t)[None])  # mask None: causal
                if j < len(branch):
                    features = torch.cat((features, out.regress[0, -1:]))  # fed back as the next position's feature
            self.memo[branch] = out.predict[0, -1]
        return self.memo[branch]

    def logprobs(self, branch: tuple[int, ...]) -> torch.Tensor:
        return F.log_softmax(self.head.logits(self.predict(branch)).float(), dim=-1)

    def tree(self, depth: int, top_k: int, total: int) -> tuple[list[tuple[int, ...]], list[int]]:
        """EAGLE-2's selection: -> the kept branches in candidate order and their ranks by cumulative log-prob."""
        branches: list[tuple[int, ...]] = []
        scores: list[float] = []
        frontier: list[int] = [-1]  # -1: the root
        for _ in range(depth):
            new = []
            for parent in frontier:
                prefix, base = (branches[parent], scores[parent]) if parent >= 0 else ((), 0.0)
                child_logp, child_ids = self.logprobs(prefix).topk(top_k)
                for lp, token in zip(child_logp.tolist(), child_ids.tolist()):
                    new.append(len(branches))
                    branches.append(prefix + (token,))
                    scores.append(base + lp)
            frontier = sorted(new, key=lambda i: -scores[i])[:top_k]
            self.frontiers.append([branches[i] for i in frontier])
        keep = sorted(sorted(range(len(scores)), key=lambda i: -scores[i])[:total])
        by_score = sorted(keep, key=lambda i: -scores[i])
        return [branches[i] for i in keep], [by_score.index(i) + 1 for i in keep]


def tree_branches(tree) -> list[tuple[int, ...]]:
    """Each drafted node's tokens from the root's child down to the node (node order)."""
    out = []
    for node in range(1, tree.size):
        path = tree.ancestors[node].nonzero().squeeze(1)[1:]  # node ids ascend with depth; drop the root
        out.append(tuple(tree.tokens[path].tolist()))
    return out


class RecordingDrafter:
    """Wraps the engine's drafter: records the head's root output and every expansion pass of each proposal."""

    def __init__(self, drafter, head: DraftModel):
        self.drafter, self.head = drafter, head
        self.proposals: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (root predict [H], [[k, H] per pass])
        self.forward = head.forward

    def __getattr__(self, name):  # everything else is the engine drafter's
        return getattr(self.drafter, name)

    def propose(self, token):
        passes: list[torch.Tensor] = []

        def recorded(*args, **kwargs):
            out = self.forward(*args, **kwargs)
            passes.append(out.predict[0].clone())
            return out

        root = self.drafter.last.predict[0, -1].clone()
        self.head.forward = recorded
        try:
            tree = self.drafter.propose(token)
        finally:
            del self.head.forward
        self.proposals.append((root, passes))
        return tree


@pytest.mark.parametrize("arch", ["griffin", "eagle"])
def test_each_node_is_drafted_from_its_own_branch_in_every_cycle(arch):
    target = tiny_model("llama", vocab_size=96, seed=2)
    head = sharp_head(target, arch)
    depth, top_k, total = 4, 3, 14
    gen = SpecGenerator(target, NoTokenizer(), head, depth=depth, top_k=top_k, total_tokens=total)
    prompt = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(3))
    drafter = RecordingDrafter(gen.make_drafter(64), head)
    trace: list = []
    chunks = list(gen._steps(prompt, 24, SamplingConfig(), gen.eos_ids(None), None, GenerationStats(), drafter,
                             trace=trace))
    sequence = torch.cat((prompt, *chunks))
    assert len(trace) == len(drafter.proposals) >= 4
    n = len(prompt)  # the root of each cycle's tree sits at position n
    deep = 0
    for (tree, path), (root, passes) in zip(trace, drafter.proposals):
        assert tree.tokens[0] == sequence[n]
        with torch.no_grad():
            hidden = target(sequence[None, :n], output_hidden_states=True).hidden_states[-1][0]
        reference = BranchReference(head, sequence[:n], hidden, sequence[n : n + 1])
        branches, ranks = reference.tree(depth, top_k, total)
        # the draft logits of the root and of every expanded node: the head run along that node's own branch
        torch.testing.assert_close(root, reference.predict(()), rtol=1e-5, atol=1e-5)
        assert len(passes) == depth - 1
        for level, predicted in enumerate(passes):
            want = torch.stack([reference.predict(branch) for branch in reference.frontiers[level]])
            error = float((predicted - want).abs().max() / want.abs().max())
            assert error < 1e-5, f"level {level + 2}, root at position {n}: relative difference {error:.2g}"
        assert tree_branches(tree) == branches, f"cycle with root at position {n}"
        assert tree.ranks()[1:].tolist() == ranks
        deep = max(deep, int(tree.depths.max()))
        n += len(path)
    assert deep >= 3  # kept nodes two levels below the root's children (every expansion pass is checked above)
