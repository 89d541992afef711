"""A link from measured all-reduces: ``seconds = call + bytes_sent / bandwidth``, fitted by least
squares, as :mod:`.network` prices a collective (``bytes_sent``: what one worker puts on its
link, ``2 (P - 1) / P`` of the payload for a ring all-reduce).

The measurements come from :func:`tf_sparsify.core.link_probe.measure_link` (the real collective)
and travel as JSON (``python -m tf_sparsify probe-link``, read by ``whatif --link``). With the
process's CPU time of each all-reduce (``cpu_seconds``) the same fit gives the exchange's host
work (:meth:`LinkMeasurement.host`): what the ranks' own cores spend on it, which compute that
runs on those cores cannot overlap.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import numpy as np

from tf_sparsify.common.checks import check_int, check_number
from tf_sparsify.step_model.network import Cluster, Link, all_reduce


@dataclass(frozen=True)
class LinkMeasurement:
    """All-reduces of ``payload_bytes`` over ``workers`` took ``seconds`` (each the median of
    its repeats, averaged over the workers, so that every worker holds the same numbers), and
    ``cpu_seconds`` of the process's CPU time (None: not measured)."""

    workers: int
    payload_bytes: tuple[int, ...]
    seconds: tuple[float, ...]
    cpu_seconds: tuple[float, ...] | None = None

    def __post_init__(self):
        check_int("workers", self.workers, 2)
        if len(self.payload_bytes) != len(self.seconds):
            raise ValueError(
                f"`seconds` must hold one time per payload size ({len(self.payload_bytes)}); "
                f"got {len(self.seconds)}"
            )
        if len(set(self.payload_bytes)) < 2:
            raise ValueError(
                "`payload_bytes` must hold at least two different sizes to fit a link; "
                f"got {self.payload_bytes!r}"
            )
        for size in self.payload_bytes:
            check_int("payload_bytes", size)
        for t in self.seconds:
            check_number("seconds", t, 0, low_open=True)
        if self.cpu_seconds is not None:
            if len(self.cpu_seconds) != len(self.payload_bytes):
                raise ValueError(
                    "`cpu_seconds` must hold one time per payload size "
                    f"({len(self.payload_bytes)}); got {len(self.cpu_seconds)}"
                )
            for t in self.cpu_seconds:
                check_number("cpu_seconds", t, 0)

    def bytes_sent(self) -> list[float]:
        """What one worker sends in each all-reduce (ring)."""
        return [all_reduce(m, self.workers, "ring").bytes_sent for m in self.payload_bytes]

    def link(self) -> Link:
        """The least-squares ``call_overhead`` (at least 0) and ``bandwidth`` (``inf`` where
        the time does not grow with the bytes)."""
        return self._fit(self.seconds)

    def host(self) -> Cluster | None:
        """The exchange's host work as a cluster whose link takes the CPU time per call and
        per byte (the same fit on ``cpu_seconds``); None when they were not measured."""
        if self.cpu_seconds is None:
            return None
        return Cluster(nodes=self.workers, inter=self._fit(self.cpu_seconds))

    def _fit(self, times: tuple[float, ...]) -> Link:
        sent = np.asarray(self.bytes_sent(), np.float64)
        seconds = np.asarray(times, np.float64)
        slope, intercept = np.polyfit(sent, seconds, 1)
        if intercept < 0:  # the times are proportional: a line through 0
            slope, intercept = float(sent @ seconds / (sent @ sent)), 0.0
        bandwidth = 1 / float(slope) if slope > 0 else math.inf
        return Link(bandwidth=bandwidth, call_overhead=float(intercept))

    def cluster(self) -> Cluster:
        return Cluster(nodes=self.workers, inter=self.link())

    def to_json(self) -> str:
        link = self.link()
        fitted = {"bandwidth_bytes_per_s": link.bandwidth, "call_seconds": link.call_overhead}
        return json.dumps({**asdict(self), "fitted": fitted}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> LinkMeasurement:
        """The measurement ``to_json`` wrote (its ``fitted`` part is recomputed, not read)."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> LinkMeasurement:
        """The measurement of ``dataclasses.asdict`` (or its JSON); other keys are ignored."""
        if not isinstance(data, dict) or not {"workers", "payload_bytes", "seconds"} <= set(data):
            raise ValueError("expected a JSON object with workers, payload_bytes and seconds")
        cpu = data.get("cpu_seconds")
        return cls(
            data["workers"],
            tuple(data["payload_bytes"]),
            tuple(data["seconds"]),
            None if cpu is None else tuple(cpu),
        )
