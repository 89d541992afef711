"""Custom training loops: ``GradientExchange`` keeps the state, ``DistributedGradientTape`` uses it.

A new ``tf.GradientTape`` is made every step, but error-feedback residuals and the RNG step of
randomized compressors must outlive it. So the state lives in a ``GradientExchange`` made once,
next to the model and optimizer (it is a ``tf.Module``: ``tf.train.Checkpoint(exchange=...)``
saves its residuals and step), and each step's tape is wrapped around it::

    exchange = tfs.horovod.GradientExchange(tfs.TopK(ratio=0.01))

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = tfs.horovod.DistributedGradientTape(tape, exchange=exchange)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_sparsify.compressors.base import Compressor
from tf_sparsify.compressors.dense import Identity
from tf_sparsify.horovod.collective import reject_xla
from tf_sparsify.horovod.hierarchy import HierarchicalState
from tf_sparsify.horovod.link import HorovodLink
from tf_sparsify.pipeline import GradientPipeline
from tf_sparsify.state import ExchangeState, StateViews


class GradientExchange(StateViews, tf.Module):
    """Compress, exchange through Horovod and average one list of gradients per step.

    The same :class:`~tf_sparsify.pipeline.GradientPipeline`,
    :class:`~tf_sparsify.state.ExchangeState` and
    :class:`~tf_sparsify.horovod.HorovodCollective` as
    :class:`~tf_sparsify.horovod.DistributedOptimizer`, with the state held here: residuals
    (error feedback), momentum buffers (``momentum_correction``), the step counter that keys
    random choices, the byte counters ``bytes_sent`` / ``dense_bytes`` and, with
    ``diagnostics_every``, the diagnostics record — made on the first call, checkpointed with
    this module (``tf.train.Checkpoint(exchange=...)``). ``bytes_to_horovod`` (what the
    collectives handed to Horovod) is not checkpointed. An exchange serves one list of
    variables; its first call in each process runs the ranks' configuration check (also after
    a restore from a checkpoint).

    Args: a compressor (``None`` is ``Identity()``) and the exchange options
    (:class:`~tf_sparsify.options.ExchangeOptions`) as keyword arguments, plus
    ``diagnostics_every`` (record the norm gap, residual norm and density every that many
    steps in :attr:`diagnostics`; 0 is off) and ``ranks_per_node`` (the hierarchical exchange,
    as in :class:`~tf_sparsify.horovod.DistributedOptimizer`; its byte counters are
    ``bytes_across_nodes`` and ``bytes_within_nodes``).
    """

    def __init__(
        self,
        compressor: Compressor | None = None,
        diagnostics_every: int = 0,
        ranks_per_node: int | None = None,
        name: str | None = None,
        **options: Any,
    ):
        super().__init__(name=name)
        pipeline = GradientPipeline(Identity() if compressor is None else compressor, **options)
        #: the state's variables in the order they were made (what checkpoints hold)
        self._state_variables: list[tf.Variable] = []
        self.ranks_per_node = ranks_per_node
        self._state = (
            ExchangeState(pipeline, self._make_variable)
            if ranks_per_node is None
            else HierarchicalState(pipeline, self._make_variable, ranks_per_node)
        )
        self._state.step = self._make_variable("step", (), tf.int64, "shared")
        self._state.enable_diagnostics(diagnostics_every)
        # The variables' signature and the per-process state, kept out of checkpoints (plain
        # objects are not tracked by tf.Module).
        self._signature: list | None = None
        self._link = HorovodLink(ranks_per_node)
        self._link.build()

    def _make_variable(self, name: str, shape, dtype, kind: str) -> tf.Variable:
        del kind  # one process is one replica: every variable is its own
        with tf.init_scope():
            variable = tf.Variable(tf.zeros(shape, dtype), trainable=False, name=name)
        self._state_variables.append(variable)
        return variable

    @property
    def pipeline(self) -> GradientPipeline:
        return self._state.pipeline

    @property
    def step(self) -> tf.Variable:
        return self._state.step

    @property
    def bytes_to_horovod(self) -> tf.Variable:
        return self._link.horovod_bytes

    @property
    def bytes_across_nodes(self) -> tf.Variable | None:
        return self._link.bytes_across_nodes

    @property
    def bytes_within_nodes(self) -> tf.Variable | None:
        return self._link.bytes_within_nodes

    def needs_state(self) -> bool:
        """Whether this exchange must outlive one tape: it keeps residuals or momenta, or
        draws randomness."""
        pipeline = self.pipeline
        stateful = pipeline.error_feedback or pipeline.momentum_correction > 0
        return stateful or pipeline.compressor.randomized

    def updates(
        self, grads: Sequence[tf.Tensor | None], variables: Sequence
    ) -> list[tf.Tensor | None]:
        """The mean over ranks of the decompressed payloads, aligned with ``grads``.

        ``None`` gradients stay ``None`` (their variables' state is left alone). Residuals and
        momenta are written only when the step was finite on every rank.
        """
        reject_xla()
        grads, variables = list(grads), list(variables)
        self._build(variables)
        return self._state.run(grads, self._link.collective(self._state)).updates

    def _build(self, variables: list) -> None:
        signature = [(list(v.shape), tf.as_dtype(v.dtype).name) for v in variables]
        if self._signature is not None:
            if signature != self._signature:
                raise ValueError(
                    "This GradientExchange was built for other variables "
                    f"({self._signature}); received {signature}. Use one exchange per "
                    "list of variables."
                )
            return
        if self._state.built:  # restored: the buffers exist, only the plan is per process
            self._state.set_pipeline(self.pipeline, variables)
        else:
            self._state.build(variables)
        self._signature = signature


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns the Horovod average of the
    decompressed payloads instead of the local gradients.

    Give ``exchange=`` (a :class:`GradientExchange` made once, outside the step) whenever the
    exchange has state to keep: error feedback, or a randomized compressor. ``compressor=``
    alone builds a throwaway exchange, which is only allowed where nothing needs keeping
    (``Identity``, ``FP16``/``BF16``/``TopK`` with ``error_feedback=False``); otherwise a
    ``ValueError`` says to make an exchange. Other tape methods pass through to ``tape``.
    """

    def __init__(
        self,
        tape: tf.GradientTape,
        compressor: Compressor | None = None,
        exchange: GradientExchange | None = None,
        **options: Any,
    ):
        if exchange is None:
            exchange = GradientExchange(compressor, **options)
            if exchange.needs_state():
                raise ValueError(
                    f"compressor={exchange.pipeline.compressor!r} with "
                    f"error_feedback={exchange.pipeline.error_feedback} keeps state across "
                    "steps (residuals or an RNG step) that a per-step tape would lose: create "
                    "`exchange = tf_sparsify.horovod.GradientExchange(compressor, ...)` once and "
                    "pass `exchange=exchange`."
                )
        elif compressor is not None or options:
            raise ValueError(
                "Give `compressor` and options, or `exchange`, not both (the exchange has them)."
            )
        self._tape = tape
        self.exchange = exchange

    def gradient(
        self,
        target,
        sources,
        output_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    ):
        flat = tf.nest.flatten(sources)
        grads = self._tape.gradient(
            target,
            flat,
            output_gradients=output_gradients,
            unconnected_gradients=unconnected_gradients,
        )
        return tf.nest.pack_sequence_as(sources, self.exchange.updates(grads, flat))

    def __getattr__(self, name: str):
        return getattr(self._tape, name)
