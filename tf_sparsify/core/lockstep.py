"""Driving a bucket's rounds in lockstep: each round, one collective call per kind carries
every unit's transfer of that kind (so a bucket of many units costs a few collectives)."""

from __future__ import annotations

import tensorflow as tf

from tf_sparsify.collectives import Collective
from tf_sparsify.common.finite import all_finite
from tf_sparsify.compressors.rounds import ALL_TO_ALL, GATHER, GATHER_ROWS, SUM, Transfer
from tf_sparsify.core.routes.route import Message


def exchange_bucket(bucket: list[Message], collective: Collective) -> tf.Tensor:
    """Drive the bucket's rounds to their outcomes, which each message's route turns into its
    updates and kept memory; returns whether the tensors every replica shares are all finite
    (every replica computes the same answer)."""
    pending = {i: next(m.rounds) for i, m in enumerate(bucket)}
    shared: list[tf.Tensor] = []
    while pending:
        received: dict[int, tuple[tf.Tensor, ...]] = {}
        for kind in (SUM, GATHER, GATHER_ROWS, ALL_TO_ALL):
            items = [(i, t) for i, t in pending.items() if t.kind == kind]
            if items:
                received.update(_transfer(collective, kind, items))
        for i in list(pending):
            try:
                pending[i] = bucket[i].rounds.send(received[i])
            except StopIteration as done:
                del pending[i]
                bucket[i].route.finish(bucket[i], done.value)
                shared += [t for t in done.value.shared if t.dtype.is_floating]
    checks = [all_finite(t) for t in shared]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


def _transfer(
    collective: Collective, kind: str, items: list[tuple[int, Transfer]]
) -> dict[int, tuple[tf.Tensor, ...]]:
    """One collective call of ``kind`` for every unit's transfer; results by unit."""
    tensors = [t for _, transfer in items for t in transfer.tensors]
    if kind == SUM:
        results = iter(collective.all_reduce_sum(tensors))
    elif kind == GATHER:
        results = iter(collective.all_gather(tensors))
    elif kind == GATHER_ROWS:
        results = iter(collective.all_gather_rows(tensors))
    else:
        splits = [transfer.splits for _, transfer in items for _ in transfer.tensors]
        results = iter(collective.all_to_all(tensors, splits))
    return {i: tuple(next(results) for _ in transfer.tensors) for i, transfer in items}
