"""What a codec costs on this replica's processor, per gradient entry: its compression with error
feedback and its decompression, timed in a ``tf.function`` (the step's own work: it never
hides under the exchange), then agreed over the ranks."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import tensorflow as tf

from tf_sparsify.collectives.base import Collective
from tf_sparsify.common.checks import check_int
from tf_sparsify.compressors.base import Codec
from tf_sparsify.core.link_probe import agree, median_seconds


def seconds_per_element(
    codecs: Sequence[Codec],
    num_elements: int,
    collective: Collective | None = None,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Each codec's median time for a float32 tensor of ``num_elements``, per element;
    averaged over the replicas of ``collective`` (the same numbers on every rank)."""
    n = check_int("num_elements", num_elements)
    check_int("repeats", repeats)
    x = tf.random.stateless_normal([n], seed=(0, 1))
    residual = tf.zeros([n])
    costs = []
    for codec in codecs:

        @tf.function
        def round_trip(x, residual, codec=codec):
            payload, ctx, remainder = codec.compress_with_feedback(x, residual, step=0)
            return codec.decompress(payload, ctx), remainder

        def call(round_trip=round_trip):
            return tf.nest.map_structure(lambda t: t.numpy(), round_trip(x, residual))

        costs.append(median_seconds(call, repeats, clock) / n)
    return agree(costs, collective)
