"""Auto's decisions: the setting of each compressed unit, from measurements every rank shares.

At the end of each interval a front end hands the tuner the interval's step time and each
unit's mean gradient norm over the interval (both agreed over the ranks). The tuner then

1. calibrates the compute-only time: the compute for which the step model predicts the
   measured step at the levels the interval ran (:func:`~.choice.compute_for`; with the
   exchange's host work when the compute shares the cores it runs on);
2. flags the units in a critical phase by Accordion's rule (:func:`~.choice.critical`) on the
   gradient norms: the norm of the gradient before compression, so a unit's own setting does
   not move it (its update's norm would: TopK holds mass back in the residual);
3. chooses the levels (:func:`~.choice.choose`): the least compression whose exchange still
   hides under the compute, else the smallest predicted step; pinned units keep theirs,
   critical units go no further than ``critical_level`` (the 16-bit cast).

Training starts dense (every unit is critical at the start). The same inputs give the same
levels on every rank, so the plans the ranks check stay equal. An ``Auto`` restored with its
memory (``Auto.memory['norms']``) gives the rule the norms the last interval before it was
saved ended with, so a resumed job flags the units the one that did not stop flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tf_sparsify.common.checks import check_int
from tf_sparsify.compressors.auto import Auto
from tf_sparsify.step_model.choice import ETA, auto_settings, choose, compute_for, critical
from tf_sparsify.step_model.network import Cluster, Link
from tf_sparsify.step_model.predict import Late
from tf_sparsify.step_model.shapes import Layers

#: one replica: nothing crosses a link
NO_LINK = Cluster(nodes=1, inter=Link(bandwidth=float("inf")))


@dataclasses.dataclass(frozen=True)
class Decision:
    """Levels chosen after ``step`` training steps, and why."""

    step: int
    #: the settings' names, per compressed unit
    settings: tuple[str, ...]
    levels: tuple[int, ...]
    critical: tuple[bool, ...]
    #: the interval's step (agreed over ranks), the compute-only time calibrated from it, and
    #: the step predicted at the new levels (seconds)
    measured: float
    compute: float
    predicted: float

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for name in self.settings:
            counts[name] = counts.get(name, 0) + 1
        parts = ", ".join(f"{n} x{c}" for n, c in counts.items())
        return (
            f"auto at step {self.step}: {parts}; step {1e3 * self.measured:.2f} ms measured, "
            f"{1e3 * self.predicted:.2f} ms predicted (compute {1e3 * self.compute:.2f} ms)"
        )


class AutoTuner:
    """Chooses ``auto``'s levels for units of ``shapes`` (the compressed units' gradient
    shapes, in position order) on ``cluster`` (``NO_LINK`` for one replica), with each
    setting's measured ``seconds_per_element``; ``host``: the exchange's host work
    (:meth:`~tf_sparsify.step_model.link_fit.LinkMeasurement.host`) where compute runs on the
    same cores, else None; ``bucket_bytes``: the plan's bucket size (None: a collective per
    unit)."""

    def __init__(
        self,
        auto: Auto,
        shapes: Sequence,
        cluster: Cluster,
        seconds_per_element: Sequence[float],
        *,
        eta: float = ETA,
        critical_level: int = 1,
        late_buckets: Late = "none",
        pinned: Mapping[int, int] | None = None,
        host: Cluster | None = None,
        bucket_bytes: int | None = None,
    ):
        if not isinstance(auto, Auto):
            raise ValueError(f"`auto` must be a tf_sparsify.Auto; received auto={auto!r}")
        self.auto = auto
        self.units = Layers(tuple(tuple(s) for s in shapes))
        self.cluster = cluster
        self.settings = auto_settings(auto, seconds_per_element)
        self.eta = eta
        self.critical_level = check_int("critical_level", critical_level, 0, len(auto.names) - 1)
        self.late_buckets = late_buckets
        self.pinned = dict(pinned or {})
        self.host = host
        self.bucket_bytes = bucket_bytes
        norms = (auto.memory or {}).get("norms")
        if norms is not None and len(norms) != len(self.units.shapes):
            raise ValueError(
                f"`auto.memory['norms']` must hold one norm per compressed unit "
                f"({len(self.units.shapes)}); received {len(norms)}"
            )
        #: each unit's gradient norm over the last interval (Accordion's rule compares)
        self.previous_norms: list[float] | None = norms
        self.decisions: list[Decision] = []

    @property
    def levels(self) -> tuple[int, ...]:
        """The levels in use (all dense until the first decision, pinned units too)."""
        return self.auto.levels or (0,) * len(self.units.shapes)

    def decide(self, step: int, measured: float, norms: Sequence[float]) -> Decision:
        """The levels after ``step`` steps whose interval took ``measured`` seconds per step,
        with these gradient ``norms`` per unit; ``self.auto`` holds them afterwards."""
        if len(norms) != len(self.units.shapes):
            raise ValueError(
                f"`norms` must hold one norm per compressed unit ({len(self.units.shapes)}); "
                f"got {len(norms)}"
            )
        flags = critical(list(norms), self.previous_norms, self.eta)
        self.previous_norms = [float(n) for n in norms]
        model = dict(
            cluster=self.cluster,
            late_buckets=self.late_buckets,
            host=self.host,
            bucket_bytes=self.bucket_bytes,
        )
        compute = compute_for(measured, self.levels, self.units, self.settings, **model)
        choice = choose(
            self.units,
            self.settings,
            compute=compute,
            pinned=self.pinned,
            critical=flags,
            critical_level=self.critical_level,
            **model,
        )
        self.auto = self.auto.with_levels(choice.levels)
        decision = Decision(
            step,
            tuple(self.auto.names[lv] for lv in choice.levels),
            choice.levels,
            tuple(flags),
            measured,
            compute,
            choice.step,
        )
        self.decisions.append(decision)
        return decision
