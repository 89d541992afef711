"""The link, measured: all-reduces of a few sizes through a front end's real collective.

Each size is all-reduced once to warm up, then ``repeats`` times; its time, and the process's
CPU time in it (every thread: the collective's own included), are the medians. The times are
then averaged over the replicas by one more all-reduce, so every rank holds the same numbers (a
decision taken from them is the same everywhere). Each call runs in a ``tf.function``, as a
training step's collectives do (Horovod, a custom transport's collective; not inside a
``tf.distribute`` replica context).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import tensorflow as tf

from tf_sparsify.collectives.base import Collective
from tf_sparsify.common.checks import check_int
from tf_sparsify.step_model.link_fit import LinkMeasurement

#: payload sizes in bytes: 4 KiB (the per-call cost) to 4 MiB (the bandwidth)
PROBE_BYTES = (2**12, 2**16, 2**20, 2**22)


def measure_link(
    collective: Collective,
    payload_bytes: Sequence[int] = PROBE_BYTES,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] | None = time.process_time,
) -> LinkMeasurement:
    """Times ``collective.all_reduce_sum`` of float32 payloads of each size (bytes, a multiple
    of 4) on ``clock`` and ``cpu_clock`` (None: no CPU time); the same
    :class:`LinkMeasurement` on every replica."""
    check_int("repeats", repeats)
    for size in payload_bytes:
        if check_int("payload_bytes", size) % 4:
            raise ValueError(f"`payload_bytes` must be multiples of 4 (float32); got {size}")
    reduce = tf.function(lambda payload: collective.all_reduce_sum([payload])[0])
    clocks = [clock] if cpu_clock is None else [clock, cpu_clock]
    medians = []
    for size in payload_bytes:
        payload = tf.ones([size // 4], tf.float32)
        medians.append(median_times(lambda p=payload: reduce(p).numpy(), repeats, clocks))
    agreed = agree([t for times in zip(*medians, strict=True) for t in times], collective)
    n = len(payload_bytes)
    cpu = None if cpu_clock is None else tuple(agreed[n:])
    return LinkMeasurement(collective.num_replicas, tuple(payload_bytes), tuple(agreed[:n]), cpu)


def median_seconds(call: Callable[[], object], repeats: int, clock: Callable[[], float]) -> float:
    """``call()`` once to warm up (the trace, negotiation, buffers), then the median time of
    ``repeats`` more calls; ``call`` must wait for its result."""
    return median_times(call, repeats, [clock])[0]


def median_times(
    call: Callable[[], object], repeats: int, clocks: Sequence[Callable[[], float]]
) -> list[float]:
    """As :func:`median_seconds`, the median on each of ``clocks`` (read around the same calls)."""
    call()
    times: list[list[float]] = [[] for _ in clocks]
    for _ in range(repeats):
        starts = [c() for c in clocks]
        call()
        for column, c, start in zip(times, clocks, starts, strict=True):
            column.append(c() - start)
    return [statistics.median(column) for column in times]


def agree(values: Sequence[float], collective: Collective | None) -> list[float]:
    """The mean of ``values`` over the replicas of ``collective`` (as they are without one),
    so that a decision taken from them is the same everywhere."""
    if collective is None:
        return [float(v) for v in values]
    (total,) = collective.all_reduce_sum([tf.constant(list(values), tf.float64)])
    return (total.numpy() / collective.num_replicas).tolist()
