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
Where a probe costs more than two plain steps, the wait is multiplied by what a losing probe costs beyond a plain step
(``cost - 1``), so that losing probes never take more than ``1 / wait`` of the time.

A batch (:func:`griffin.batch.decode_rows`) verifies in each row as many prompt-lookup nodes as the row that found the
longest match, so at large batch sizes, where a pass's cost grows with its width (in fp32 at batch 8 on the Xeon, 8
tokens per row cost 2.14x one: ``benchmarks/results/pass-cost.md``), a cycle can cost far more than the tuner's
per-request estimate. Given the forward-cost curve measured at the batch size (``curve``), the policy keeps a running
mean of the lookup nodes per row the tree cycles verified, beside the acceptance ratio, and prices each shape at it.
A batch takes as many cycles as its slowest row needs, and where most of a pass's cost is fixed (reading the weights)
tokens accepted in the other rows save little, so a batch keeps the acceptance ratio per row and decides on the
lowest. On the CPU a batch also runs a probe only where every row's context repeats its last n-gram (so that every
row's lookup chain has something to copy; :meth:`griffin.batch.BatchPromptLookup.promising`) and a plain step
otherwise: where a batch's tuner kept no tree, the head's tree alone does not pay, so a probe without a chain in
every row costs more than it can give. Which batches adapt at all: :meth:`griffin.SpecGenerator.batch_shapes`.

One request where the tuner kept no tree gates its probes the same way (:meth:`griffin.drafters.PromptLookup.
promising`), and adapts only while its best tree would pay on a request accepting :data:`ADAPT_RATIO` times what the
tuner expects (:func:`needed_ratio`); where a pass over a few tokens costs nearly as many plain steps (bf16 on a CPU
without bf16 instructions) it runs the plain loop.

Decisions use token counts and the tuner's cost table only, never the clock: the same request with the same seed
takes the same shapes and gives the same output on a machine. Every shape is verified losslessly, so the output is
the target's whatever the shapes (greedy: identical; sampling: the target's distribution, each cycle's rule being
exact given what came before). Nothing here is written to the tuning cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

SMOOTHING = 0.1  # each tree cycle weighs 1 - SMOOTHING times the next one in the running acceptance ratio
PRIOR = 1.0  # the tuner's expectation counts as this many cycles in the running ratio
PROBE, MAX_PROBE = 4, 32  # plain tokens before a tree is tried again, at first and at most
MARGIN = 0.03  # the hysteresis around plain decoding's rate: a tree is left below 1 - MARGIN, retaken above 1 + MARGIN
# plain steps a batch's probe may cost beyond what it is expected to give (see probe_excess); on an AVX-512 EPYC,
# where it keeps batch 4 from adapting, batch 4 with it out of reach read 0.98x (bf16) and 0.99x (fp32) the gated
# batch on second turns (benchmarks/results/amd-epyc-zen4/gate-b4.md)
PROBE_EXCESS = 1.0
# the largest batch that adapts where its tuner kept no tree: on the Xeon in fp32, probing only where every row's
# lookup finds its n-gram, adapting cost nothing measurable on MT-Bench first turns at batch 2 and 4 (1.02x, 1.01x)
# and paid on second turns (1.25x, 1.06x); batch 8 is off there by PROBE_EXCESS, benchmarks/results/batch-adapt/
ADAPT_ROWS = 4
# where the tuner kept no tree, one request adapts only while some tree pays on a request that accepts this many times
# what the tuner expects (MT-Bench's second turns accept about twice their first turns' drafted tokens): on an AVX2 CPU
# in bf16, where a pass over 2 tokens costs 1.6x one, the best tree needed 2.15x and adapting read 0.94x on first
# turns and 1.04x on second turns; in fp32 it needed 1.0x and read 1.12x and 1.73x (benchmarks/results/amd-epyc/)
ADAPT_RATIO = 2.0


@dataclass(frozen=True)
class Shape:
    """A tree shape with what the tuner measured for it: ``tau`` tokens per cycle, ``cost`` seconds per cycle over
    the seconds of a plain step."""

    depth: int
    total_tokens: int
    tau: float
    cost: float
    most: int = 0  # the most tokens one cycle can emit (the longest path plus the bonus; 0: depth + 1)
    nodes: float = 0.0  # nodes per row the tuner priced a cycle at, root and lookup chain included (0: unknown)

    @property
    def chain(self) -> float:
        """Lookup nodes per row the tuner expected a cycle to verify."""
        return max(self.nodes - self.total_tokens - 1, 0.0)

    @property
    def name(self) -> str:
        return "plain" if self.total_tokens == 0 else f"{self.total_tokens}x{self.depth}"


PLAIN = Shape(0, 0, 1.0, 1.0)  # no tree: the plain loop


def price(curve: dict[int, float], nodes: float) -> float:
    """A pass over ``nodes`` tokens per row in plain steps, from ``curve`` (measured sizes -> plain steps): linear
    between the two nearest sizes, and past the largest along its last segment (the tuner stops measuring once a pass
    costs more than any tree can pay, where lookup chains still reach)."""
    sizes = sorted(curve)
    cost = float(numpy.interp(nodes, sizes, [curve[n] for n in sizes]))
    if nodes > sizes[-1] and len(sizes) > 1:
        slope = (curve[sizes[-1]] - curve[sizes[-2]]) / (sizes[-1] - sizes[-2])
        cost += slope * (nodes - sizes[-1])
    return cost


def repriced(shape: Shape, curve: dict[int, float] | None, chain: float) -> float:
    """Plain steps a cycle of ``shape`` costs when each row verifies ``chain`` lookup nodes: the tuner's cost, its
    lookup nodes moved along ``curve`` (None: the tuner's cost as it is)."""
    if curve is None or not shape.nodes:
        return shape.cost
    return shape.cost + (price(curve, shape.total_tokens + 1 + chain) - price(curve, shape.nodes))


def probe_excess(shape: Shape, curve: dict[int, float] | None, lookup: int) -> float:
    """Plain steps a cycle of ``shape`` costs beyond the tokens the tuner expects it to give when every row verifies
    a full lookup chain of ``lookup`` tokens (in a batch, the common case: one row's match widens every row). Where
    the tuner kept no tree at a batch size, a probe gives about that and a request that accepts no more than the
    tuner's pays it on every probe: batches adapt there only while it is at most :data:`PROBE_EXCESS`."""
    return repriced(shape, curve, lookup) - shape.tau


def needed_ratio(shapes: list[Shape]) -> float:
    """How many times the tuner's expected acceptance a request must accept for a cycle of the best of ``shapes`` to
    give the plain steps it costs (its tokens, ``1 + ratio * (tau - 1)``, equal to its cost)."""
    return min((s.cost - 1) / (s.tau - 1) for s in shapes if s.tau > 1)


class ShapePolicy:
    """Per request: the shape of each next cycle from the tree ``shapes`` (and :data:`PLAIN`), given what the cycles
    so far emitted. The first cycle takes the best shape by the tuner's estimates; ``plain_first`` (the tuner measured
    that no tree pays at this band) makes the probes after it wait longest from the start, and a loop then runs a probe
    only where its drafter sees a use for one (``promising``; a plain step otherwise). ``curve``: a pass's cost in
    plain steps by nodes per row at this batch size, to price the lookup nodes the cycles verify (None: the tuner's
    costs as they are)."""

    def __init__(self, shapes: list[Shape], plain_first: bool = False, smoothing: float = SMOOTHING,
                 probe: int = PROBE, max_probe: int = MAX_PROBE, margin: float = MARGIN, prior: float = PRIOR,
                 curve: dict[int, float] | None = None):
        trees = [s for s in shapes if s.total_tokens > 0 and s.tau > 1]
        if not trees:
            raise ValueError("adaptation needs at least one tree shape that the tuner expects to accept tokens")
        self.trees, self.smoothing, self.margin, self.prior, self.curve = trees, smoothing, margin, prior, curve
        self.seen: dict[int, float] = {0: 0.0}  # per row, decayed sums over tree cycles of accepted / expected
        self.weight = 0.0  # decayed count of tree cycles (a batch's rows start together and only leave)
        self.chained = 0.0  # decayed sum over tree cycles of the lookup nodes per row verified
        self.first_wait, self.max_probe, self.plain_first = probe, max_probe, plain_first
        self.wait = max_probe if plain_first else probe  # plain tokens between probes now
        self.plain_run = 0  # plain tokens since the last tree cycle
        self.current = self.best()

    @property
    def ratio(self) -> float:
        """Accepted drafted tokens over the tuner's expectation, running (1 before any tree cycle); in a batch, that
        of the row accepting least, which sets how many cycles the batch takes."""
        return (self.prior + min(self.seen.values())) / (self.prior + self.weight)

    def cost(self, shape: Shape) -> float:
        """Plain steps a cycle of ``shape`` is expected to take: the tuner's cost, its lookup nodes repriced at the
        running mean of those verified (with a curve; at least a plain step)."""
        if self.curve is None or not shape.nodes:
            return shape.cost
        chain = (self.prior * shape.chain + self.chained) / (self.prior + self.weight)
        return max(repriced(shape, self.curve, chain), 1.0)

    def rate(self, shape: Shape) -> float:
        """Expected tokens per plain step's time with ``shape`` for this request."""
        return min(1 + self.ratio * (shape.tau - 1), shape.most or shape.depth + 1) / self.cost(shape)

    def best(self) -> Shape:
        return max(self.trees, key=self.rate)

    def shape(self) -> Shape:
        """The shape of the next cycle."""
        return self.current

    @property
    def probing(self) -> bool:
        """Whether the next cycle is a probe: a tree after plain steps, or the request's first cycle. With
        ``plain_first`` a loop runs a plain step instead where its drafter sees no use for a tree now
        (:meth:`griffin.drafters.PromptLookup.promising`, :meth:`griffin.batch.BatchPromptLookup.promising`), and
        the policy observes that step as any other."""
        return self.current is not PLAIN and (self.plain_run > 0 or self.weight == 0)

    def observe(self, shape: Shape, emitted: int | dict[int, int], width: int | None = None) -> None:
        """A cycle of ``shape`` emitted ``emitted`` tokens (the bonus included; a batch: row -> its tokens, the rows
        still decoding), verifying ``width`` nodes per row (root and lookup chain included; None: as the tuner
        expected); choose the next shape."""
        if shape is PLAIN:
            self.plain_run += 1
            if self.plain_run >= self.wait:
                best = self.best()
                # a probe (one cycle of the best tree) after ``wait`` plain steps, or that many times what a losing
                # probe costs beyond a plain step where that is more (a batch's wide passes): at most 1 / wait is lost
                if self.plain_run >= self.wait * max(1.0, self.cost(best) - 1):
                    self.current = best
            return
        after_plain = self.plain_run > 0
        probe = after_plain or self.weight == 0  # the first cycle of a request is a probe too
        self.plain_run = 0
        keep = 1 - self.smoothing
        rows = emitted if isinstance(emitted, dict) else {0: emitted}
        self.seen = {row: keep * self.seen.get(row, 0.0) + (e - 1) / (shape.tau - 1) for row, e in rows.items()}
        self.weight = keep * self.weight + 1
        self.chained = keep * self.chained + (shape.chain if width is None else max(width - shape.total_tokens - 1, 0))
        best = self.best()
        # hysteresis: a tree runs on while it holds plain decoding's rate within the margin, and takes over from
        # plain decoding (after a probe) only when it beats that rate by the margin
        if self.rate(best) > (1 + self.margin if probe else 1 - self.margin):
            self.current, self.wait = best, self.first_wait
        else:
            self.current = PLAIN
            if after_plain:  # a probe lost: wait longer before the next one
                self.wait = min(2 * self.wait, self.max_probe)
