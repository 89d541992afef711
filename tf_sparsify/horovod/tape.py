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

from typing import Any

import tensorflow as tf

from tf_sparsify.compressors.base import Compressor
from tf_sparsify.custom_loop import gradient_exchange as exchange
from tf_sparsify.horovod.byte_counters import HorovodByteCounters
from tf_sparsify.horovod.transport import HorovodTransport


class GradientExchange(HorovodByteCounters, exchange.GradientExchange):
    """A :class:`tf_sparsify.GradientExchange` whose payloads travel by Horovod (its transport
    is a :class:`~tf_sparsify.horovod.HorovodTransport`), averaged over the ranks.

    ``bytes_to_horovod`` (what the collectives handed to Horovod) is not checkpointed. The
    first call in each process runs the ranks' configuration check (also after a restore from
    a checkpoint).

    Args: as :class:`tf_sparsify.GradientExchange`, plus ``ranks_per_node`` (the hierarchical
    exchange, as in :class:`~tf_sparsify.horovod.DistributedOptimizer`; its byte counters are
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
        super().__init__(
            compressor, HorovodTransport(ranks_per_node), diagnostics_every, name, **options
        )


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
                    f"error_feedback={exchange.pipeline.options.error_feedback} keeps state across "
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
