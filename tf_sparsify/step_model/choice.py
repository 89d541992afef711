"""Which setting each unit should be sent with: the least compression whose exchange still hides
under the compute that can overlap it, by the step model of :mod:`.predict`.

A setting is one way to send a unit (dense fp32, FP16, TopK at a ratio, ...), listed from the
least compression to the most, with its own compression cost per element (measured; it never
hides). Every unit starts at its least compression allowed. Then, one level at a time on one
unit, or on all the units a bucket sends with one setting (raising one of many small units
alone would add a collective's call cost to its bucket), compression goes up where it shortens
the predicted step most (a single unit first, at equal steps), until the exchange hides (the
step is its compute plus the compression costs) or no raise shortens the step any more. Of
the choices on that way, the first whose predicted step is within ``tolerance`` (2 %) of the
last one's is taken: compression costs accuracy the step model does not see, so it is not
raised for a step a few per cent shorter. A unit the user pins keeps its setting; a unit in
a critical phase (:func:`critical`) may not go past ``critical_level``. The rule is greedy
and predictable: the same inputs give the same choice, and a unit is never compressed more
than the step needs.

The units travel in buckets as the plan makes them (``bucket_bytes`` of dense gradient, in
backprop order: :func:`.buckets.fill_buckets`), one collective per setting and bucket: a
bucket's units sent with one setting pay one call and their bytes together (None: each unit
alone, its own call). The step is :func:`.predict.step_time` with backprop overlap: a bucket's
exchange starts when backward has made its last gradient (the last layers' bucket first), and
late buckets (``late_buckets``: the first layers' bucket, or all) from the step's start.
Given the exchange's host work (``host``: the CPU time of the same collectives, from
:meth:`~.link_fit.LinkMeasurement.host`), that work adds to the compute: where compute runs on
the cores the collective's copies and sums run on (a CPU-only job), none of it can hide.

The accuracy guard is Accordion's (Agarwal et al., MLSys 2021): a unit is in a critical phase
when the norm of its gradient summed over an interval changed by ``eta`` or more (relative)
since the previous interval, and at the start (no previous interval). Accordion's rule needs
only the norms every rank already has after the exchange, and it is one threshold a user can
read; an error budget (L-GreCo) would need each setting's error per unit measured each interval.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from tf_sparsify.common.checks import check_int, check_number
from tf_sparsify.compressors.auto import Auto
from tf_sparsify.step_model.buckets import fill_buckets
from tf_sparsify.step_model.methods import DenseAllReduce, Method, TopKAllGather
from tf_sparsify.step_model.network import Cluster
from tf_sparsify.step_model.predict import BACKWARD_FRACTION, Late, step_time, transfers_time
from tf_sparsify.step_model.shapes import Layers

#: Accordion's threshold on the relative change of a unit's gradient norm between intervals
ETA = 0.5
#: how much longer than the shortest predicted step the least compression may be
TOLERANCE = 0.02


@dataclass(frozen=True)
class Setting:
    """One way to send a unit: the step model's ``method`` and the compressor's own cost,
    ``seconds_per_element`` (select, encode, decode; measured)."""

    name: str
    method: Method
    seconds_per_element: float = 0.0

    def __post_init__(self):
        check_number("seconds_per_element", self.seconds_per_element, low=0)


def auto_settings(auto: Auto, seconds_per_element: Sequence[float]) -> list[Setting]:
    """The step model's view of ``auto``'s settings (dense, the 16-bit cast, TopK at each
    density), each with its own cost per element (measured, one per setting)."""
    costs = list(seconds_per_element)
    if len(costs) != len(auto.settings):
        raise ValueError(
            f"`seconds_per_element` must hold one cost per setting of {auto!r} "
            f"({len(auto.settings)}); got {len(costs)}"
        )
    methods = [
        DenseAllReduce(4),
        DenseAllReduce(2, name=auto.half),
        *(TopKAllGather(d) for d in auto.densities),
    ]
    return [
        Setting(name, method, cost)
        for name, method, cost in zip(auto.names, methods, costs, strict=True)
    ]


@dataclass(frozen=True)
class Choice:
    """A setting level per unit (an index into the settings), the predicted step and its parts
    (seconds), and whether the exchange hides under the compute."""

    levels: tuple[int, ...]
    step: float
    compute: float
    overhead: float
    #: the exchange's host work (0 without ``host``)
    host: float = 0.0

    @property
    def hidden(self) -> bool:
        return self.step <= self.compute + self.overhead


def predicted_step(
    levels: Sequence[int],
    units: Layers,
    settings: Sequence[Setting],
    cluster: Cluster,
    compute: float,
    late_buckets: Late = "none",
    backward_fraction: float = BACKWARD_FRACTION,
    host: Cluster | None = None,
    bucket_bytes: int | None = None,
) -> Choice:
    """The step of ``units`` (first layer's first) sent at these setting ``levels``; ``host``:
    the exchange's host work, which does not hide (None: all of the exchange may);
    ``bucket_bytes``: the plan's bucket size (None: a collective per unit)."""
    prices = _Prices.of(units, settings, cluster, host, bucket_bytes)
    return prices.step(levels, compute, late_buckets, backward_fraction)


@dataclass(frozen=True)
class _Prices:
    """The seconds of each setting's collective without payload (its calls and rounds) and,
    per unit, what its bytes add to it, on the link and on the host; the compression cost per
    unit and setting. A bucket's collective of one setting is its fixed part plus its units'
    parts: exact where the time grows with the bytes in proportion (a link without a token
    bucket's burst). Priced once for the many steps a choice compares."""

    sizes: tuple[int, ...]
    #: each unit's bucket (0 travels first: the last layers')
    buckets: tuple[int, ...]
    fixed: tuple[float, ...]
    comms: tuple[tuple[float, ...], ...]
    host_fixed: tuple[float, ...]
    work: tuple[tuple[float, ...], ...]
    costs: tuple[tuple[float, ...], ...]

    @classmethod
    def of(
        cls,
        units: Layers,
        settings: Sequence[Setting],
        cluster: Cluster,
        host: Cluster | None,
        bucket_bytes: int | None,
    ) -> _Prices:
        # None: each unit its own bucket (a bucket closes at any unit's first byte)
        backprop = fill_buckets([4 * size for size in reversed(units.sizes)], bucket_bytes or 1)
        costs = tuple(tuple(s.seconds_per_element * n for s in settings) for n in units.sizes)
        fixed, comms = _collective_times(units, settings, cluster)
        host_fixed, work = _collective_times(units, settings, host)
        return cls(
            tuple(units.sizes), tuple(reversed(backprop)), fixed, comms, host_fixed, work, costs
        )

    def step(
        self, levels: Sequence[int], compute: float, late_buckets: Late, backward_fraction: float
    ) -> Choice:
        if len(levels) != len(self.sizes):
            raise ValueError(f"`levels` must hold one level per unit ({len(self.sizes)})")
        count = max(self.buckets) + 1
        comms, sizes, calls = [0.0] * count, [0] * count, set()
        work = overhead = 0.0
        for unit, level in enumerate(levels):
            bucket = self.buckets[unit]
            comms[bucket] += self.comms[unit][level]
            sizes[bucket] += self.sizes[unit]
            work += self.work[unit][level]
            overhead += self.costs[unit][level]
            calls.add((bucket, level))
        for bucket, level in calls:
            comms[bucket] += self.fixed[level]
            work += self.host_fixed[level]
        step = step_time(
            compute + work,
            overhead,
            comms[::-1],  # the first layers' bucket first
            "backprop",
            late_buckets,
            sizes[::-1],
            backward_fraction,
        )
        return Choice(tuple(levels), step, compute, overhead, work)


def _collective_times(
    units: Layers, settings: Sequence[Setting], on: Cluster | None
) -> tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]:
    """Per setting, its collectives' seconds on ``on`` without payload (calls and rounds),
    and per unit and setting, what the unit's bytes add to them (all 0 for None)."""
    if on is None:
        return (0.0,) * len(settings), tuple((0.0,) * len(settings) for _ in units.shapes)
    alone = [[s.method.transfers(Layers((shp,)), on) for s in settings] for shp in units.shapes]
    fixed = tuple(transfers_time([replace(t, bytes_sent=0.0) for t in ts], on) for ts in alone[0])
    parts = tuple(
        tuple(transfers_time(ts, on) - f for ts, f in zip(row, fixed, strict=True)) for row in alone
    )
    return fixed, parts


def choose(
    units: Layers,
    settings: Sequence[Setting],
    cluster: Cluster,
    compute: float,
    *,
    pinned: Mapping[int, int] | None = None,
    critical: Sequence[bool] | None = None,
    critical_level: int = 1,
    late_buckets: Late = "none",
    backward_fraction: float = BACKWARD_FRACTION,
    host: Cluster | None = None,
    bucket_bytes: int | None = None,
    tolerance: float = TOLERANCE,
) -> Choice:
    """The levels for ``units`` (see the module's docstring); ``pinned``: ``{unit: level}``;
    ``critical``: per unit, whether it is in a critical phase (then at most
    ``critical_level``); ``host`` and ``bucket_bytes`` as :func:`predicted_step` takes them;
    ``tolerance``: the relative step the least compression may add to the shortest."""
    compute = check_number("compute", compute, low=0)
    tolerance = check_number("tolerance", tolerance, low=0)
    n, top = len(units.shapes), len(settings) - 1
    if top < 0:
        raise ValueError("`settings` must hold at least one setting")
    check_int("critical_level", critical_level, 0, top)
    critical = [False] * n if critical is None else list(critical)
    if len(critical) != n:
        raise ValueError(f"`critical` must hold one flag per unit ({n}); got {len(critical)}")
    pinned = dict(pinned or {})
    for unit, level in pinned.items():
        check_int("pinned unit", unit, 0, n - 1)
        check_int(f"pinned[{unit}]", level, 0, top)
    caps = [critical_level if c else top for c in critical]
    levels = [pinned.get(i, 0) for i in range(n)]

    prices = _Prices.of(units, settings, cluster, host, bucket_bytes)

    def step_of(levels: Sequence[int]) -> Choice:
        return prices.step(levels, compute, late_buckets, backward_fraction)

    way = [step_of(levels)]
    while not way[-1].hidden:
        raises = [i for i in range(n) if i not in pinned and levels[i] < caps[i]]
        together: dict[tuple[int, int], set[int]] = {}
        for i in raises:
            together.setdefault((prices.buckets[i], levels[i]), set()).add(i)
        moves = [{i} for i in raises] + [g for g in together.values() if len(g) > 1]
        tried = [step_of([lv + (j in m) for j, lv in enumerate(levels)]) for m in moves]
        if not tried or min(t.step for t in tried) >= way[-1].step:
            break
        way.append(min(tried, key=lambda t: t.step))
        levels = list(way[-1].levels)
    return next(c for c in way if c.step <= way[-1].step * (1 + tolerance))


def compute_for(
    measured: float,
    levels: Sequence[int],
    units: Layers,
    settings: Sequence[Setting],
    cluster: Cluster,
    late_buckets: Late = "none",
    backward_fraction: float = BACKWARD_FRACTION,
    host: Cluster | None = None,
    bucket_bytes: int | None = None,
) -> float:
    """The compute-only time for which :func:`predicted_step` gives the ``measured`` step at
    these ``levels`` (the predicted step grows with the compute; 0 when the exchange and the
    compression costs alone take longer than ``measured``); ``host`` and ``bucket_bytes`` as
    there."""
    measured = check_number("measured", measured, low=0)

    prices = _Prices.of(units, settings, cluster, host, bucket_bytes)

    def step(compute: float) -> float:
        return prices.step(levels, compute, late_buckets, backward_fraction).step

    low, high = 0.0, measured
    if step(low) >= measured:
        return 0.0
    while high - low > 1e-6 * measured:
        middle = (low + high) / 2
        low, high = (middle, high) if step(middle) < measured else (low, middle)
    return (low + high) / 2


def critical(
    norms: Sequence[float], previous: Sequence[float] | None, eta: float = ETA
) -> list[bool]:
    """Accordion's rule per unit: ``|norm - previous| >= eta * previous`` (the norms of the
    gradients summed over the interval now ending and over the one before); every unit is
    critical at the start (``previous`` None)."""
    eta = check_number("eta", eta, low=0, low_open=True)
    if previous is None:
        return [True] * len(norms)
    if len(previous) != len(norms):
        raise ValueError(
            f"`previous` must hold one norm per unit ({len(norms)}); got {len(previous)}"
        )
    return [abs(a - b) >= eta * b for a, b in zip(norms, previous, strict=True)]
