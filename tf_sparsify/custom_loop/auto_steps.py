"""``AutoSteps``: runs an ``Auto`` compressor's decisions for any front end, step by step.

A front end (the Keras optimizer through :class:`~tf_sparsify.keras.AutoCompression`, or a
custom loop's :class:`~tf_sparsify.custom_loop.GradientExchange`) is attached once, before its
step is traced: that turns on its record of each unit's gradient norm (every
``interval // 4`` steps unless it is on already; the step's routes stay as they are). Then
:meth:`AutoSteps.step_done` after every step: after the first one it measures the link through
the front end's transport (or takes the one given) and each setting's own cost; every
``interval`` steps it hands the interval's median step and each unit's mean gradient norm to the
tuner (:class:`~tf_sparsify.core.auto_tuner.AutoTuner`), gives the front end the new ``Auto``
(residuals carry over; its memory holds the norms, the link and the count of decisions, so a
checkpoint carries them) and, when the levels changed, returns True: the caller retraces its
step before the next one. The intervals end at multiples of ``interval`` of the front end's
exchange steps, and a front end restored from a checkpoint takes the link from the ``Auto`` it
restored instead of measuring it: a resumed job decides when and as the one that did not stop.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Mapping

import numpy as np
import tensorflow as tf

from tf_sparsify.common.checks import check_int
from tf_sparsify.compressors.auto import Auto
from tf_sparsify.core.auto_tuner import NO_LINK, AutoTuner, Decision
from tf_sparsify.core.codec_cost import seconds_per_element
from tf_sparsify.core.link_probe import agree, measure_link
from tf_sparsify.step_model.choice import ETA
from tf_sparsify.step_model.link_fit import LinkMeasurement
from tf_sparsify.step_model.network import Cluster


class AutoSteps:
    """Chooses the setting of each unit of a front end's :class:`~tf_sparsify.Auto`.

    Args:
        interval: steps between decisions (at least 2).
        link: the link measured before (``python -m tf_sparsify probe-link``), kept as it is,
            or None to measure it after the first step (one replica: nothing to measure).
        link_every: decisions between two measurements of the link (a shared link's load
            changes), or None to measure it once.
        eta: Accordion's threshold on the relative change of a unit's mean gradient norm.
        critical_level: the most compression a unit gets in a critical phase (1: the 16-bit
            cast).
        pinned: ``{variable path: setting name}`` (a path as ``variable.path`` gives it,
            e.g. ``"model/dense/kernel"``; a setting as ``Auto.names``: ``"dense"``,
            ``"fp16"``, ``"topk1%"``, ...): those units keep that setting.
        verbose: 1 prints each decision.

    :attr:`decisions` lists every decision, :attr:`links` every link measured (with the step),
    :attr:`overhead` the seconds spent measuring and deciding.
    """

    def __init__(
        self,
        interval: int = 100,
        link: LinkMeasurement | None = None,
        *,
        link_every: int | None = 10,
        eta: float = ETA,
        critical_level: int = 1,
        pinned: Mapping[str, str] | None = None,
        verbose: int = 0,
    ):
        self.interval = check_int("interval", interval, 2)
        if link is not None and not isinstance(link, LinkMeasurement):
            raise ValueError(f"`link` must be a LinkMeasurement or None; received link={link!r}")
        self.link = link
        self._link_given = link is not None
        self.link_every = None if link_every is None else check_int("link_every", link_every)
        #: ``(steps done, link)`` for each measurement of the link
        self.links: list[tuple[int, LinkMeasurement]] = []
        self.eta = eta
        self.critical_level = critical_level
        self.pinned = dict(pinned or {})
        self.verbose = verbose
        self.tuner: AutoTuner | None = None
        #: seconds spent measuring and deciding (not training)
        self.overhead = 0.0
        self._front_end = None
        self._times: list[float] = []
        self._last: float | None = None
        self._steps = 0

    @property
    def decisions(self) -> list[Decision]:
        return [] if self.tuner is None else list(self.tuner.decisions)

    def attach(self, front_end) -> bool:
        """Decide for ``front_end`` (its compressor an ``Auto``), before its step is traced;
        True when this turned its gradient-norm record on (a step traced before must be
        retraced). A built front end under a strategy: call it in the strategy's scope."""
        if not isinstance(front_end.compressor, Auto):
            raise ValueError(
                "AutoSteps needs a front end whose compressor is tf_sparsify.Auto(); got "
                f"compressor={front_end.compressor!r}"
            )
        self._front_end = front_end
        self._last = None
        if front_end.grad_sq_norms_every:
            return False
        front_end.enable_grad_sq_norms(max(1, self.interval // 4))
        return True

    def pause(self) -> None:
        """The time until the next :meth:`step_done` is no step (e.g. between epochs)."""
        self._last = None

    def step_done(self) -> bool:
        """After each step: True when the settings changed (retrace the step before the next)."""
        if self._front_end is None:
            raise ValueError("call `attach(front_end)` before the first step")
        now = time.perf_counter()
        if self._last is not None:
            self._times.append(now - self._last)
        self._last = now
        self._steps += 1
        if self.tuner is None:
            self._start()
            return False
        self._sample_norms()
        if self._steps % self.interval == 0 and self._times and self._norms:
            return self._decide()
        return False

    def _start(self) -> None:
        """After the first step (the front end is built): the link and the settings' costs."""
        began = time.perf_counter()
        front = self._front_end
        units = sorted((u for u in front.units if u.position is not None), key=lambda u: u.position)
        collective = front.transport.job_collective()
        auto = front.compressor
        memory = auto.memory or {}
        self._steps = int(front.exchange_steps.numpy())  # a restored front end's count
        if self.link is None and memory.get("link") is not None:
            self.link = LinkMeasurement.from_dict(memory["link"])
        elif self.link is None and collective is not None:
            self._measure_link(collective)
        costs = seconds_per_element(
            auto.settings, max((u.num_elements for u in units), default=1), collective
        )
        self.tuner = AutoTuner(
            auto,
            [tuple(u.shape) for u in units],
            NO_LINK if self.link is None else self.link.cluster(),
            costs,
            eta=self.eta,
            critical_level=self.critical_level,
            late_buckets=front.pipeline.options.late_buckets,
            bucket_bytes=front.pipeline.options.bucket_bytes,
            pinned=self._pinned_levels(units, auto),
            host=self._host(),
        )
        self._collective = collective
        # the record's row of each compressed unit (a change of setting keeps the units)
        rows = {u.indices: r for r, u in enumerate(front.units)}
        self._rows = [rows[u.indices] for u in units]
        self._norms: list[list[float]] = []
        self._sampled = int(front.grad_sq_norms_step.numpy())
        self._times = []
        self._last = time.perf_counter()
        self.overhead += self._last - began

    def _measure_link(self, collective) -> None:
        self.link = measure_link(collective)
        self.links.append((self._steps, self.link))

    def _host(self) -> Cluster | None:
        """The exchange's host work where the step computes on the CPU (no GPU): the cores the
        collective's copies and sums need too. None with a GPU, or a link without CPU times."""
        if self.link is None or tf.config.list_logical_devices("GPU"):
            return None
        return self.link.host()

    def _pinned_levels(self, units: list, auto: Auto) -> dict[int, int]:
        front = self._front_end
        names = dict(zip((u.indices for u in front.units), front.diagnostics_names, strict=True))
        positions = {names[u.indices]: u.position for u in units}
        pinned = {}
        for name, setting in self.pinned.items():
            if name not in positions:
                raise ValueError(
                    f"`pinned` names a variable that is not compressed: {name!r}; the "
                    f"compressed ones are {sorted(positions)}"
                )
            if setting not in auto.names:
                raise ValueError(
                    f"`pinned[{name!r}]` must be one of {list(auto.names)}; received {setting!r}"
                )
            pinned[positions[name]] = auto.names.index(setting)
        return pinned

    def _sample_norms(self) -> None:
        """Each unit's gradient norm at the last step the record was written, if new."""
        step = int(self._front_end.grad_sq_norms_step.numpy())
        if step == self._sampled:
            return
        self._sampled = step
        grad_sq = self._front_end.grad_sq_norms.numpy()[self._rows, 0]
        self._norms.append([math.sqrt(g) for g in grad_sq])

    def _decide(self) -> bool:
        began = time.perf_counter()
        measured, *norms = agree(
            [statistics.median(self._times), *np.mean(self._norms, axis=0)], self._collective
        )
        # decisions made, a restored job's before it too (the first uses the starting link)
        done = (self.tuner.auto.memory or {}).get("decided", 0)
        measures = not self._link_given and self._collective is not None and self.link_every
        if measures and done and done % self.link_every == 0:
            self._measure_link(self._collective)
            self.tuner.cluster, self.tuner.host = self.link.cluster(), self._host()
        before = self.tuner.levels
        decision = self.tuner.decide(self._steps, measured, norms)
        if self.verbose:
            print(decision.summary())
        self._times, self._norms = [], []
        changed = decision.levels != before
        self.tuner.auto = self.tuner.auto.with_memory(
            {
                "norms": self.tuner.previous_norms,
                "link": None if self.link is None else dataclasses.asdict(self.link),
                "decided": done + 1,
            }
        )
        self._front_end.set_compressor(self.tuner.auto)  # its memory, at least, is new
        # the next step's time leaves the decision out; after a change it retraces: no time
        self._last = None if changed else time.perf_counter()
        self.overhead += time.perf_counter() - began
        return changed
