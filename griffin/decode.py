"""The decode loop: speculative cycles with a drafter, and the plain loop where no tree is drafted.

:func:`decode` is the one generation loop of the package (the cycle and its invariants: ``docs/design.md``). It is a
function of its collaborators (the target's :class:`griffin.backend.TargetBackend`, a drafter, a verifier, a KV
cache), so that :class:`griffin.SpecGenerator` and the tuner (:mod:`griffin.autotune`) drive it alike. A cycle with
no drafted node is the plain loop itself (:func:`griffin.plain.plain_steps`, the same code and kernels as
:func:`griffin.plain.plain_generate`); with a :class:`griffin.adapt.ShapePolicy` the tree's shape may change from one
cycle to the next, down to no tree and back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .adapt import PLAIN, Shape, ShapePolicy
from .backend import TargetBackend
from .kv_cache import BufferCache
from .plain import plain_steps
from .sampling import SamplingConfig, sample_token
from .tree import Tree
from .verify import Drafter, Verifier, default_verifier


@dataclass
class GenerationStats:
    new_tokens: int = 0
    cycles: int = 0  # target passes after the prefill (a plain step is one too)
    accepted_hist: dict[int, int] = field(default_factory=dict)  # tokens emitted per cycle (bonus included) -> count
    # the split of the time below is measured only with timing on (SpecGenerator(timing=True)): it synchronises
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    prefill_s: float = 0.0
    wall_s: float = 0.0  # time spent generating (not by the consumer of the stream), always measured
    plain_steps: int = 0  # cycles decoded without a tree (the plain loop)
    shapes: dict[str, int] = field(default_factory=dict)  # tree cycles per shape "nodes x depth" (adaptation)

    @property
    def tau(self) -> float:
        """Acceptance length: new tokens per verification pass."""
        return self.new_tokens / self.cycles if self.cycles else float(self.new_tokens)

    def as_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "cycles": self.cycles, "tau": self.tau,
                "accepted_hist": dict(sorted(self.accepted_hist.items())), "draft_s": self.draft_s,
                "verify_s": self.verify_s, "other_s": self.other_s, "prefill_s": self.prefill_s, "wall_s": self.wall_s,
                "plain_steps": self.plain_steps, "shapes": dict(self.shapes)}

    def count(self, emitted: int) -> None:
        """One cycle that emitted ``emitted`` tokens."""
        self.cycles += 1
        self.accepted_hist[emitted] = self.accepted_hist.get(emitted, 0) + 1
        self.new_tokens += emitted


class _Clock:
    """Adds the time since the last lap to a stats field; synchronises the device so that the split is honest.
    Disabled (``enabled=False``), a lap does nothing at all."""

    def __init__(self, device: torch.device, stats: GenerationStats, enabled: bool):
        self.sync = device.type == "cuda"
        self.stats, self.enabled = stats, enabled
        self.t = time.perf_counter()

    def lap(self, name: str | None = None) -> None:
        if not self.enabled:
            return
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if name is not None:
            setattr(self.stats, name, getattr(self.stats, name) + now - self.t)
        self.t = now


def emitted_count(out: torch.Tensor, length: torch.Tensor, eos: torch.Tensor,
                  remaining: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of a cycle's tokens to emit, on the device: out [D+1] (a accepted tokens, the bonus, padding), length
    a (0-dim) -> (count, stop) 0-dim longs: up to and including the first EOS, at most ``remaining``; stop is 1 when
    an EOS was emitted or the budget is spent."""
    steps = torch.arange(out.shape[0], device=out.device)
    hit = torch.isin(out, eos) & (steps <= length)
    first_eos = torch.where(hit, steps, out.shape[0]).min()
    count = torch.minimum(length, first_eos).clamp(max=remaining - 1) + 1
    stop = (first_eos < out.shape[0]) | (count == remaining)
    return count, stop.long()


@torch.inference_mode()
def decode(backend: TargetBackend, drafter: Drafter | None, ids: torch.Tensor, max_new_tokens: int,
           sampling: SamplingConfig, eos: torch.Tensor, generator: torch.Generator | None, stats: GenerationStats,
           cache: BufferCache, *, verifier: Verifier | None = None, policy: ShapePolicy | None = None,
           timing: bool = False, trace: list | None = None) -> Iterator[torch.Tensor]:
    """ids [P] -> the new tokens of each cycle (a CPU LongTensor [n], the prefill's token first) until EOS or
    ``max_new_tokens``, written into ``cache`` (room for P + max_new_tokens + the largest proposal + 1 positions).

    ``drafter`` None: the plain loop throughout. Else each cycle asks ``policy`` (if any) for its shape
    (:data:`griffin.adapt.PLAIN`: a plain step; a tree shape: ``drafter.resize(depth, total_tokens)``) and reports
    what the cycle emitted; where the policy starts plain (its tuner kept no tree), a probe runs only where the
    drafter's ``promising`` (if it has one) sees a use for it, and a plain step otherwise. ``verifier``: the
    acceptance rule (default: the drafter's ``verifier(sampling, generator)`` if it has one, else
    :func:`griffin.verify.default_verifier`). ``timing``: split the time into ``stats`` (synchronises the device).
    ``trace``, if given, receives ``(tree, path)`` of every tree cycle.
    One host sync per cycle (the emitted tokens with their count and the stop flag)."""
    clock = _Clock(backend.device, stats, timing)
    started = time.perf_counter()
    hidden, logits = backend.prefill(ids, cache)
    token = sample_token(logits[-1], sampling, generator)  # [1]
    first, stop = torch.cat((token, torch.isin(token, eos).long())).tolist()  # host sync
    clock.lap("prefill_s")
    stats.new_tokens = 1
    stats.wall_s += time.perf_counter() - started
    yield torch.tensor([first])
    started = time.perf_counter()
    if max_new_tokens == 1 or stop:
        return
    clock.lap()
    if drafter is not None:
        drafter.start(ids, hidden, token)
        if verifier is None:
            choose = getattr(drafter, "verifier", None)
            verifier = choose(sampling, generator) if choose else default_verifier(sampling, generator)
    clock.lap("draft_s")
    unread: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tokens, features) emitted since the drafter last read
    promising = getattr(drafter, "promising", None)

    def held(shape: Shape | None) -> bool:
        """Whether the cycle runs plainly: no tree asked for, or a probe the drafter sees no use for where the policy
        starts plain (the tuner kept no tree)."""
        if shape is PLAIN:
            return True
        if shape is None or promising is None or not (policy.plain_first and policy.probing):
            return False
        return not promising(torch.cat([t for t, _ in unread]) if unread else token.new_zeros(0))

    shape = PLAIN if drafter is None else (policy.shape() if policy else None)
    plain = held(shape)
    while True:
        if plain:  # plain steps until the policy asks for a tree again (and the drafter sees a use for it)
            with backend.weight_major:  # held for the stretch, as plain_generate holds it
                layers = backend.feature_layers if drafter is not None else None  # what the drafter will read
                for new, features in plain_steps(backend.model, cache, token, sampling, generator, layers):
                    token = new
                    value, stop = torch.cat((token, torch.isin(token, eos).long())).tolist()  # the host sync
                    stats.count(1)
                    stats.plain_steps += 1
                    if drafter is not None:
                        unread.append((token, features))
                    clock.lap("verify_s")
                    stats.wall_s += time.perf_counter() - started
                    yield torch.tensor([value])
                    started = time.perf_counter()
                    if stop or stats.new_tokens == max_new_tokens:
                        return
                    clock.lap()
                    if policy is not None:
                        policy.observe(PLAIN, 1)
                        shape = policy.shape()
                        plain = held(shape)
                        if not plain:
                            break
            continue
        if shape is not None:
            drafter.resize(shape.depth, shape.total_tokens)
            stats.shapes[shape.name] = stats.shapes.get(shape.name, 0) + 1
        if unread:  # what the plain steps emitted: the drafter reads it at once
            drafter.accept(torch.cat([t for t, _ in unread]), torch.cat([f for _, f in unread]))
            unread.clear()
            clock.lap("draft_s")
        n = cache.length  # position of the root: the newest token, not yet seen by the target
        tree: Tree = drafter.propose(token)
        clock.lap("draft_s")
        hidden, logits = backend.forward(tree.tokens, n + tree.depths, tree.ancestors, cache)
        clock.lap("verify_s")
        accepted = verifier.accept(tree, logits)
        cache.keep(n, n + accepted.path)  # the accepted entries (and padding) right after the context
        out = accepted.emitted(tree)  # [D+1]
        count, stop = emitted_count(out, accepted.length, eos, max_new_tokens - stats.new_tokens)
        host = torch.cat((out, torch.stack((count, accepted.length, stop)))).tolist()  # the host sync
        count, length, stop = host[-3:]
        cache.crop(n + count)
        if trace is not None:
            trace.append((tree, accepted.path[: length + 1]))
        stats.count(count)
        clock.lap("other_s")
        stats.wall_s += time.perf_counter() - started
        yield torch.tensor(host[:count])
        started = time.perf_counter()
        if stop:
            return
        clock.lap()  # time spent by the consumer is nobody's
        token = out[count - 1 : count]
        if policy is not None:
            policy.observe(shape, count)
            shape = policy.shape()
        if shape is PLAIN:
            unread.append((out[:count], hidden[accepted.path[:count]]))
        else:
            drafter.accept(out[:count], hidden[accepted.path[:count]])
        plain = held(shape)
        clock.lap("draft_s")
