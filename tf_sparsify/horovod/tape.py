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

import tensorflow as tf

from tf_sparsify.compressors.base import Compressor
from tf_sparsify.compressors.dense import Identity
from tf_sparsify.horovod.check import check_once, plan_fields
from tf_sparsify.horovod.collective import HorovodCollective
from tf_sparsify.pipeline import GradientPipeline, bytes_per_step


class GradientExchange(tf.Module):
    """Compress, exchange through Horovod and average one list of gradients per step.

    The same :class:`~tf_sparsify.pipeline.GradientPipeline` and
    :class:`~tf_sparsify.horovod.HorovodCollective` as
    :class:`~tf_sparsify.horovod.DistributedOptimizer`, with its state held here: one residual
    variable per compressed variable with error feedback (created on the first call), the step
    counter that keys random choices, and the byte counters ``bytes_sent`` (the pipeline's wire
    bytes, summed over steps) and ``bytes_to_horovod`` (what the collectives handed to Horovod;
    not checkpointed). An exchange serves one list of variables; its first call in each process
    runs the ranks' configuration check (also after a restore from a checkpoint).

    Args: as :class:`~tf_sparsify.pipeline.GradientPipeline` (``compressor=None`` is
    ``Identity()``).
    """

    def __init__(
        self,
        compressor: Compressor | None = None,
        error_feedback: bool | None = None,
        scope: str = "layer",
        min_size: int = 0,
        skip_1d: bool = False,
        local_clipnorm: float | None = None,
        name: str | None = None,
    ):
        super().__init__(name=name)
        self.pipeline = GradientPipeline(
            Identity() if compressor is None else compressor,
            error_feedback,
            scope,
            min_size,
            skip_1d=skip_1d,
            local_clipnorm=local_clipnorm,
        )
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self.bytes_sent = tf.Variable(0, dtype=tf.int64, trainable=False, name="bytes_sent")
        self.residuals: list[tf.Variable | None] | None = None
        # The plan and per-process state, kept out of checkpoints (a plain object is not
        # tracked by tf.Module).
        self._local = _Untracked()

    @property
    def bytes_to_horovod(self) -> tf.Variable:
        return self._local.horovod_bytes

    @property
    def units(self) -> list:
        """The planned messages of one step (empty before the first call)."""
        return list(self._local.units)

    @property
    def wire_bytes_per_step(self) -> int:
        return bytes_per_step(self.units)[0]

    def needs_state(self) -> bool:
        """Whether this exchange must outlive one tape: it keeps residuals or draws randomness
        (an unbiased compressor other than ``Identity`` is randomized)."""
        compressor = self.pipeline.compressor
        randomized = compressor.unbiased and not isinstance(compressor, Identity)
        return self.pipeline.error_feedback or randomized

    def average(
        self, grads: Sequence[tf.Tensor | None], variables: Sequence
    ) -> list[tf.Tensor | None]:
        """The mean over ranks of the decompressed payloads, aligned with ``grads``.

        ``None`` gradients stay ``None`` (and their variables' messages are skipped).
        Residuals are written only when the step was finite on every rank.
        """
        grads, variables = list(grads), list(variables)
        self._build(variables)
        units = self._local.units
        gate = check_once(self._local.checked, plan_fields(self.pipeline, units))
        collective = HorovodCollective(after=gate, counter=self._local.horovod_bytes)
        residuals = [None if r is None else r.value() for r in self.residuals]
        result = self.pipeline.step(units, grads, residuals, self.step.value(), collective)
        pairs = [
            (r, new)
            for r, new in zip(self.residuals, result.residuals, strict=True)
            if r is not None and new is not None
        ]
        if pairs:

            def store() -> tf.Tensor:
                for r, new in pairs:
                    r.assign(new)
                return tf.constant(True)

            tf.cond(result.finite, store, lambda: tf.constant(False))
        self.bytes_sent.assign_add(result.sent_bytes[0])
        self.step.assign_add(1)
        return result.updates

    def _build(self, variables: list) -> None:
        shapes = [tf.TensorShape(v.shape) for v in variables]
        dtypes = [tf.as_dtype(v.dtype) for v in variables]
        signature = [(s.as_list(), d.name) for s, d in zip(shapes, dtypes, strict=True)]
        if self._local.signature is not None:
            if signature != self._local.signature:
                raise ValueError(
                    "This GradientExchange was built for other variables "
                    f"({self._local.signature}); received {signature}. Use one exchange per "
                    "list of variables."
                )
            return
        units = self.pipeline.plan(shapes, dtypes)
        needs = self.pipeline.needs_residual(units, len(variables))
        with tf.init_scope():
            self.residuals = [
                tf.Variable(tf.zeros(s, d), trainable=False, name=f"residual_{i}") if need else None
                for i, (s, d, need) in enumerate(zip(shapes, dtypes, needs, strict=True))
            ]
        self._local.units = units
        self._local.signature = signature


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
        error_feedback: bool | None = None,
        scope: str = "layer",
        min_size: int = 0,
        exchange: GradientExchange | None = None,
    ):
        if exchange is None:
            exchange = GradientExchange(compressor, error_feedback, scope, min_size)
            if exchange.needs_state():
                raise ValueError(
                    f"compressor={exchange.pipeline.compressor!r} with "
                    f"error_feedback={exchange.pipeline.error_feedback} keeps state across "
                    "steps (residuals or an RNG step) that a per-step tape would lose: create "
                    "`exchange = tf_sparsify.horovod.GradientExchange(compressor, ...)` once and "
                    "pass `exchange=exchange`."
                )
        elif compressor is not None:
            raise ValueError("Give `compressor` or `exchange`, not both (the exchange has one).")
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
        return tf.nest.pack_sequence_as(sources, self.exchange.average(grads, flat))

    def __getattr__(self, name: str):
        return getattr(self._tape, name)


class _Untracked:
    """The plan, and the per-process check flag and Horovod byte counter."""

    def __init__(self):
        self.units: list = []
        self.signature: list | None = None
        self.checked = tf.Variable(False, trainable=False, name="plan_checked")
        self.horovod_bytes = tf.Variable(0, dtype=tf.int64, trainable=False, name="horovod_bytes")
