"""One-step-late buckets: a width-2 pipeline of steps (``ExchangeOptions.late_buckets``).

A late unit's gradient of step ``t`` is kept in an in-flight buffer (per replica, like a
residual) and goes through the pipeline at step ``t + 1``: compressed with the unit's
residual, exchanged and applied one step late. The state core runs the pipeline twice per step,
first on the in-flight gradients, then on the current gradients of the other units. The first
run reads only variables (the in-flight buffers, residuals, compressor states), so nothing in it
depends on the step's forward or backward pass: TensorFlow's executor runs its compression and
collectives while the step computes. At step 0 the in-flight buffers are zero: the late units'
first update is zero. :func:`flush_gradients` gives the step that applies what is still in
flight (zero gradients for the late units, none for the others).

With every bucket late this is ``ServerOptimizer(DelayedGradients(1))`` made real: the same
compressed contributions, applied one step late.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_sparsify.collectives import Collective
from tf_sparsify.core import replica_values
from tf_sparsify.core.plan import Unit
from tf_sparsify.core.step import StepFlags, StepMemory, StepResult


def late_variables(units: Sequence[Unit], num_variables: int, mode: str) -> list[bool]:
    """Which variables travel one step late: none, those of the last bucket backprop fills
    (the highest bucket number: the first layers') or all."""
    flags = [False] * num_variables
    if mode == "none" or not units:
        return flags
    last = max(u.bucket for u in units)
    for unit in units:
        if mode == "all" or unit.bucket == last:
            for i in unit.indices:
                flags[i] = True
    return flags


def late_in_step(late: Sequence[bool], grads: Sequence) -> list[bool]:
    """The variables that travel late in a step: the late ones, but for a gradient that is
    ``tf.IndexedSlices`` (an embedding's rows), which travels in its step, as rows. An
    in-flight buffer would hold it dense and send TopK of the whole table; its buffer keeps
    what it holds (nothing, unless an earlier trace sent that variable dense) for the flush."""
    return [
        is_late and not isinstance(g, tf.IndexedSlices)
        for g, is_late in zip(grads, late, strict=True)
    ]


def split(grads: Sequence, late: Sequence[bool]) -> tuple[list, list]:
    """``(late gradients, current gradients)``: each list keeps its own variables' gradients
    and ``None`` for the other's."""
    late_grads = [g if is_late else None for g, is_late in zip(grads, late, strict=True)]
    now = [None if is_late else g for g, is_late in zip(grads, late, strict=True)]
    return late_grads, now


def merge(late: StepResult, now: StepResult) -> StepResult:
    """One step's result from the late run and the current run (disjoint variables and units).
    The step is finite when both are: a non-finite part keeps every buffer as it was."""
    return StepResult(
        updates=_either(late.updates, now.updates),
        residuals=_either(late.residuals, now.residuals),
        finite=tf.logical_and(late.finite, now.finite),
        momenta=None if now.momenta is None else _either(late.momenta, now.momenta),
        stats=None if now.stats is None else late.stats + now.stats,
        sent_bytes=(
            late.sent_bytes[0] + now.sent_bytes[0],
            late.sent_bytes[1] + now.sent_bytes[1],
        ),
        states=None if now.states is None else _either(late.states, now.states),
    )


def _either(first: list, second: list) -> list:
    return [b if a is None else a for a, b in zip(first, second, strict=True)]


def flush_gradients(late: Sequence[bool], variables: Sequence) -> list:
    """The gradients of the step that applies what is in flight: zeros for the late variables
    (the next in-flight values), ``None`` for the others (they do not travel)."""
    return [
        tf.zeros(v.shape, v.dtype) if is_late else None
        for v, is_late in zip(variables, late, strict=True)
    ]


def run_late_then_now(
    state: Any, grads: list, memory: StepMemory, collective: Collective, flags: StepFlags
) -> StepResult:
    """One step of ``state`` (a :class:`~tf_sparsify.core.state.CompressionState` with late
    units): the in-flight gradients of the late units (keyed by the step they were computed
    in, as if sent then), then this step's of the others, through the pipeline; this step's
    late gradients go in flight."""
    # an identity in the replica's device scope: a traced read of a sync-on-read variable has
    # no device, which MultiWorkerMirroredStrategy's all-reduce refuses
    arrived = [
        None if v is None else tf.identity(v)
        for v in replica_values.current_values(state.in_flight)
    ]
    late_grads, now = split(grads, late_in_step(state.late, grads))
    sent = [a if g is not None else None for a, g in zip(arrived, late_grads, strict=True)]
    computed_in = dataclasses.replace(memory, iteration=state.step - 1)
    parts = [(sent, computed_in), (now, memory)]
    results = [
        state.transport.run_pipeline(state.pipeline, state.units, g, m, collective, flags)
        for g, m in parts
        if any(x is not None for x in g)  # a run with nothing to send is left out
    ]
    result = results[0] if len(results) == 1 else merge(*results)
    for buffer, g in zip(state.in_flight, late_grads, strict=True):
        if buffer is not None and g is not None:
            buffer.assign(tf.convert_to_tensor(g))
    return result
