"""Adaptation during a generation: the tree's shape follows what the request accepts, down to no tree and back.

The tuner (:mod:`griffin.autotune`) measures, once per machine and temperature band, what each tree shape would accept
on generic requests and what a cycle of it costs against a plain decoding step. A request can accept far more (a
rewrite of its context, a second turn that quotes the first) or far less (a translation) than those requests did.
:class:`ShapePolicy` keeps, per request, one running number: the ratio of the drafted tokens the trees got accepted to
those the tuner expected of them, a mean over the recent tree cycles (each weighing ``1 - SMOOTHING`` times the one
after it) that starts from the tuner's expectation counted as ``PRIOR`` cycles, so that the first cycles of a request
move it at once. Scaled by it, each shape's expected rate is ``tau / cost`` tokens per plain step; the policy runs the
best shape while its rate stays above plain decoding's (rate 1) less ``MARGIN``, and plain decoding once it falls
below; a tree takes over again when it beats rate 1 by ``MARGIN``. The first cycle of a request runs the best tree
whatever the tuner expected (the tuner's generic requests can undervalue a request by far: MT-Bench's second turns
accept twice what they do). While decoding plainly it learns nothing about acceptance, so it probes: after ``probe``
plain tokens one cycle runs the best tree, and each probe that still loses doubles the wait (up to ``max_probe``).

Decisions use token counts and the tuner's cost table only, never the clock: the same request with the same seed
takes the same shapes and gives the same output on a machine. Every shape is verified losslessly, so the output is
the target's whatever the shapes (greedy: identical; sampling: the target's distribution, each cycle's rule being
exact given what came before). Nothing here is written to the tuning cache.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.1  # each tree cycle weighs 1 - SMOOTHING times the next one in the running acceptance ratio
PRIOR = 1.0  # the tuner's expectation counts as this many cycles in the running ratio
PROBE, MAX_PROBE = 4, 32  # plain tokens before a tree is tried again, at first and at most
MARGIN = 0.03  # the hysteresis around plain decoding's rate: a tree is left below 1 - MARGIN, retaken above 1 + MARGIN


@dataclass(frozen=True)
class Shape:
    """A tree shape with what the tuner measured for it: ``tau`` tokens per cycle, ``cost`` seconds per cycle over
    the seconds of a plain step."""

    depth: int
    total_tokens: int
    tau: float
    cost: float
    most: int = 0  # the most tokens one cycle can emit (the longest path plus the bonus; 0: depth + 1)

    @property
    def name(self) -> str:
        return "plain" if self.total_tokens == 0 else f"{self.total_tokens}x{self.depth}"


PLAIN = Shape(0, 0, 1.0, 1.0)  # no tree: the plain loop


class ShapePolicy:
    """Per request: the shape of each next cycle from the tree ``shapes`` (and :data:`PLAIN`), given what the cycles
    so far emitted. The first cycle takes the best shape by the tuner's estimates; ``plain_first`` (the tuner measured
    that no tree pays at this band) makes the probes after it wait longest from the start."""

    def __init__(self, shapes: list[Shape], plain_first: bool = False, smoothing: float = SMOOTHING,
                 probe: int = PROBE, max_probe: int = MAX_PROBE, margin: float = MARGIN, prior: float = PRIOR):
        trees = [s for s in shapes if s.total_tokens > 0 and s.tau > 1]
        if not trees:
            raise ValueError("adaptation needs at least one tree shape that the tuner expects to accept tokens")
        self.trees, self.smoothing, self.margin, self.prior = trees, smoothing, margin, prior
        self.seen, self.weight = 0.0, 0.0  # decayed sums over tree cycles: accepted / expected, and cycles
        self.first_wait, self.max_probe = probe, max_probe
        self.wait = max_probe if plain_first else probe  # plain tokens between probes now
        self.plain_run = 0  # plain tokens since the last tree cycle
        self.current = self.best()

    @property
    def ratio(self) -> float:
        """Accepted drafted tokens over the tuner's expectation, running (1 before any tree cycle)."""
        return (self.prior + self.seen) / (self.prior + self.weight)

    def rate(self, shape: Shape) -> float:
        """Expected tokens per plain step's time with ``shape`` for this request."""
        return min(1 + self.ratio * (shape.tau - 1), shape.most or shape.depth + 1) / shape.cost

    def best(self) -> Shape:
        return max(self.trees, key=self.rate)

    def shape(self) -> Shape:
        """The shape of the next cycle."""
        return self.current

    def observe(self, shape: Shape, emitted: int) -> None:
        """A cycle of ``shape`` emitted ``emitted`` tokens (the bonus included); choose the next shape."""
        if shape is PLAIN:
            self.plain_run += 1
            if self.plain_run >= self.wait:
                self.current = self.best()  # a probe: one cycle of the best tree
            return
        after_plain = self.plain_run > 0
        probe = after_plain or self.weight == 0  # the first cycle of a request is a probe too
        self.plain_run = 0
        keep = 1 - self.smoothing
        self.seen = keep * self.seen + (emitted - 1) / (shape.tau - 1)
        self.weight = keep * self.weight + 1
        best = self.best()
        # hysteresis: a tree runs on while it holds plain decoding's rate within the margin, and takes over from
        # plain decoding (after a probe) only when it beats that rate by the margin
        if self.rate(best) > (1 + self.margin if probe else 1 - self.margin):
            self.current, self.wait = best, self.first_wait
        else:
            self.current = PLAIN
            if after_plain:  # a probe lost: wait longer before the next one
                self.wait = min(2 * self.wait, self.max_probe)
