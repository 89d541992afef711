"""The link, measured (``core.link_probe``) and fitted (``step_model.link_fit``): exact on a
collective whose every call takes ``call + bytes_sent / bandwidth`` on a clock of its own."""

from __future__ import annotations

import pytest
import tensorflow as tf

from tf_sparsify.collectives.base import Collective
from tf_sparsify.core.link_probe import PROBE_BYTES, measure_link
from tf_sparsify.step_model.link_fit import LinkMeasurement

CALL, BANDWIDTH = 2e-4, 1.25e8  # 200 us per call, 1 Gbit/s
#: the CPU the process spends on each call: 150 us, and 1 s per 2 GB sent (copies and sums)
CPU_CALL, CPU_BANDWIDTH = 1.5e-4, 2e9


class TimedCollective(Collective):
    """``num_replicas`` replicas holding the same tensors; each all-reduce advances ``now`` by
    what the link would take (ring: ``2 (P - 1) / P`` of the payload sent), when it runs (in
    the graph, as a real collective's time passes)."""

    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self.now = self.cpu = 0.0

    def clock(self) -> float:
        return self.now

    def cpu_clock(self) -> float:
        return self.cpu

    def all_reduce_sum(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        payload = sum(t.shape.num_elements() * t.dtype.size for t in tensors)
        p = self.num_replicas

        def advance():
            self.now += CALL + 2 * (p - 1) / p * payload / BANDWIDTH
            self.cpu += CPU_CALL + 2 * (p - 1) / p * payload / CPU_BANDWIDTH
            return 0

        with tf.control_dependencies([tf.py_function(advance, [], tf.int32)]):
            return [t * p for t in tensors]


@pytest.mark.parametrize("replicas", [2, 5])
def test_the_measured_link_is_the_one_the_collective_runs_on(replicas):
    collective = TimedCollective(replicas)
    measured = measure_link(
        collective, repeats=3, clock=collective.clock, cpu_clock=collective.cpu_clock
    )
    assert measured.workers == replicas and measured.payload_bytes == PROBE_BYTES
    sent = 2 * (replicas - 1) / replicas
    want = [CALL + sent * m / BANDWIDTH for m in PROBE_BYTES]
    assert measured.seconds == pytest.approx(want, rel=1e-9)
    link = measured.link()
    assert link.bandwidth == pytest.approx(BANDWIDTH, rel=1e-6)
    assert link.call_overhead == pytest.approx(CALL, rel=1e-6)
    assert measured.cluster().workers == replicas
    host = measured.host()
    assert host.workers == replicas
    assert host.inter.bandwidth == pytest.approx(CPU_BANDWIDTH, rel=1e-6)
    assert host.inter.call_overhead == pytest.approx(CPU_CALL, rel=1e-6)
    assert measure_link(collective, repeats=1, cpu_clock=None).host() is None


def test_a_measurement_round_trips_through_json():
    measured = LinkMeasurement(2, (4096, 1048576), (3e-4, 9e-3))
    text = measured.to_json()
    assert LinkMeasurement.from_json(text) == measured
    with_cpu = LinkMeasurement(2, (4096, 1048576), (3e-4, 9e-3), (1e-4, 1e-3))
    assert LinkMeasurement.from_json(with_cpu.to_json()) == with_cpu
    assert '"bandwidth_bytes_per_s"' in text and '"call_seconds"' in text


def test_times_that_do_not_grow_or_start_at_zero():
    flat = LinkMeasurement(2, (4096, 1048576), (1e-3, 1e-3)).link()
    assert flat.bandwidth > 1e15 and flat.call_overhead == pytest.approx(1e-3)  # no limit seen
    proportional = LinkMeasurement(2, (1000, 2000), (1e-6, 2.5e-6)).link()  # a line below 0
    assert proportional.call_overhead == 0 and proportional.bandwidth > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1, (4096, 8192), (1e-3, 2e-3)), "workers"),
        ((2, (4096, 4096), (1e-3, 2e-3)), "two different sizes"),
        ((2, (4096, 8192), (1e-3,)), "one time per payload size"),
        ((2, (4096, 8192), (1e-3, -1.0)), "seconds"),
        ((2, (0, 8192), (1e-3, 2e-3)), "payload_bytes"),
        ((2, (4096, 8192), (1e-3, 2e-3), (1e-4,)), "`cpu_seconds` must hold one time"),
        ((2, (4096, 8192), (1e-3, 2e-3), (1e-4, -1.0)), "cpu_seconds"),
    ],
)
def test_bad_measurements_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        LinkMeasurement(*args)


def test_bad_probes_are_named():
    collective = TimedCollective(2)
    with pytest.raises(ValueError, match="repeats"):
        measure_link(collective, repeats=0)
    with pytest.raises(ValueError, match="multiples of 4"):
        measure_link(collective, payload_bytes=(4096, 1001))
    with pytest.raises(ValueError, match="JSON object"):
        LinkMeasurement.from_json("[1, 2]")
