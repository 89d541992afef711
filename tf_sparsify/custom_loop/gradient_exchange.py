"""``GradientExchange``: the exchange state of a custom training loop, for any transport.

A custom loop computes its gradients itself and wants them exchanged: compressed, carried to the
other replicas, averaged. The error-feedback residuals, momenta and the step that keys random
choices must outlive each step, so they live here, in a ``tf.Module`` made once next to the
model (``tf.train.Checkpoint(exchange=...)`` saves them). Each step::

    updates = exchange.updates(grads, model.trainable_variables)
    optimizer.apply(updates, model.trainable_variables)

The transport says how payloads travel: tf.distribute's replica context by default (call
:meth:`GradientExchange.updates` inside ``strategy.run``), Horovod with
:class:`~tf_sparsify.horovod.GradientExchange`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_sparsify.compressors.base import Compressor
from tf_sparsify.compressors.dense import Identity
from tf_sparsify.core import late
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.state import CompressionState
from tf_sparsify.core.state_kinds import StateKind
from tf_sparsify.core.transport import Transport
from tf_sparsify.custom_loop.front_end import FrontEnd


class GradientExchange(FrontEnd, tf.Module):
    """Compress, exchange and average one list of gradients per step.

    The same :class:`~tf_sparsify.core.pipeline.GradientPipeline` and
    :class:`~tf_sparsify.core.state.CompressionState` as the Keras optimizer wrapper, with the state
    held here: residuals (error feedback), momentum buffers (``momentum_correction``), the step
    counter that keys random choices, the byte counters ``bytes_sent`` / ``dense_bytes`` and,
    with ``diagnostics_every``, the diagnostics record. An exchange serves one list of
    variables.

    Under a ``tf.distribute`` strategy make it (and :meth:`build` it) in ``strategy.scope()``:
    each replica then keeps its own residuals (sync-on-read variables). The updates are the
    sum over replicas of the decompressed payloads (Keras and ``tf.nn.compute_average_loss``
    scale each replica's loss by ``1 / replicas``): apply them with an optimizer that does not
    all-reduce them again (:func:`tf_sparsify.keras.skip_gradient_all_reduce`).

    Args: a compressor (``None`` is ``Identity()``), the transport (``None``: tf.distribute's
    replica context, or one replica), ``diagnostics_every`` (record the norm gap, residual norm
    and density every that many steps in :attr:`diagnostics`; 0 is off) and the exchange
    options (:class:`~tf_sparsify.core.options.ExchangeOptions`) as keyword arguments.
    """

    def __init__(
        self,
        compressor: Compressor | None = None,
        transport: Transport | None = None,
        diagnostics_every: int = 0,
        name: str | None = None,
        **options: Any,
    ):
        super().__init__(name=name)
        pipeline = GradientPipeline(Identity() if compressor is None else compressor, **options)
        self._state = CompressionState(pipeline, self._make_variable, transport)
        self._state.step = self._state.new_variable("step", (), tf.int64, StateKind.SHARED)
        self.enable_diagnostics(diagnostics_every)
        #: what ``tf.train.Checkpoint(exchange=...)`` saves: the whole state as one entry
        self._checkpointed = self._state.checkpoint
        # The variables' signature, kept out of checkpoints (plain objects are not tracked).
        self._signature: list | None = None

    def _make_variable(self, name: str, shape, dtype, kind: StateKind) -> tf.Variable:
        """A zero variable; under a strategy held across replicas as its kind says (each
        replica writes its own copy of per-replica kinds, counters the first replica)."""
        sync = {}
        if tf.distribute.has_strategy():
            kind = StateKind(kind)
            sync = {"synchronization": kind.synchronization, "aggregation": kind.aggregation}
        with tf.init_scope():
            return tf.Variable(tf.zeros(shape, dtype), trainable=False, name=name, **sync)

    @property
    def step(self) -> tf.Variable:
        return self._state.step

    def needs_state(self) -> bool:
        """Whether this exchange must outlive one step: it keeps residuals, momenta or
        gradients in flight, or draws randomness."""
        pipeline = self.pipeline
        options = pipeline.options
        stateful = options.error_feedback or options.momentum_correction > 0
        stateful = stateful or options.late_buckets != "none"
        return stateful or pipeline.compressor.randomized

    def build(self, variables: Sequence) -> None:
        """Plan the messages for ``variables`` and make their buffers (done by the first
        :meth:`updates` call outside a replica context; under a strategy call it in
        ``strategy.scope()`` before the first step)."""
        variables = list(variables)
        signature = [(list(v.shape), tf.as_dtype(v.dtype).name) for v in variables]
        if self._signature is not None:
            if signature != self._signature:
                raise ValueError(
                    "This GradientExchange was built for other variables "
                    f"({self._signature}); received {signature}. Use one exchange per "
                    "list of variables."
                )
            return
        self._state.build(variables)
        self._state.checkpoint.build()
        self._signature = signature

    def updates(
        self, grads: Sequence[tf.Tensor | None], variables: Sequence
    ) -> list[tf.Tensor | None]:
        """The averaged decompressed payloads, aligned with ``grads``.

        ``None`` gradients stay ``None`` (their variables' state is left alone). Residuals and
        momenta are written only when the step was finite on every replica.
        """
        return self._step(grads, variables, flush=False)

    def _step(self, grads: Sequence, variables: Sequence, flush: bool) -> list[tf.Tensor | None]:
        """:meth:`updates`; ``flush``: the step applies what is in flight."""
        grads, variables = list(grads), list(variables)
        if self._signature is None and _in_replica_of_many():
            raise ValueError(
                "Build the GradientExchange before the first step under a strategy: call "
                "`exchange.build(model.trainable_variables)` inside `strategy.scope()`."
            )
        self.build(variables)
        return self._state.run(grads, self._state.collective(grads, flush)).updates

    def in_flight_updates(self, variables: Sequence) -> list[tf.Tensor | None]:
        """With ``late_buckets``: the averaged updates still in flight after the last step
        (the late variables' last gradients), ``None`` for the other variables; apply them
        after the last step, as the steps' updates (in ``strategy.run`` under a strategy),
        so no gradient is lost. Without late buckets: all ``None``."""
        variables = list(variables)
        self.build(variables)
        if not any(self._state.late):
            return [None] * len(variables)
        return self._step(late.flush_gradients(self._state.late, variables), variables, flush=True)


def _in_replica_of_many() -> bool:
    """Whether this runs in one replica of a strategy with several (no variables made here)."""
    context = tf.distribute.get_replica_context()
    return tf.distribute.has_strategy() and context is not None and context.num_replicas_in_sync > 1
