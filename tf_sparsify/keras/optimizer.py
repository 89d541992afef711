"""``SparsifiedOptimizer``: a Keras 3 optimizer that compresses gradients before they travel."""

from __future__ import annotations

import warnings
from typing import Any

import keras
import tensorflow as tf

from tf_sparsify.collectives import Collective
from tf_sparsify.compressors.base import Compressor, deserialize
from tf_sparsify.compressors.rounds import SparseUpdate
from tf_sparsify.core import late
from tf_sparsify.core.options import ExchangeOptions
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.state import CompressionState
from tf_sparsify.core.step import StepResult
from tf_sparsify.core.transport import Transport
from tf_sparsify.custom_loop.front_end import FrontEnd
from tf_sparsify.keras import (
    auto_jit,
    inner_options,
    keras_private,
    multi_worker,
    sparse_sgd,
    wrapped,
)
from tf_sparsify.keras.optimizer_variables import OptimizerVariables
from tf_sparsify.keras.wrapped import find_sparsified

__all__ = ["SparsifiedOptimizer", "find_sparsified"]


@keras.saving.register_keras_serializable(package="tf_sparsify")
@inner_options.read_through
class SparsifiedOptimizer(OptimizerVariables, FrontEnd, keras.optimizers.Optimizer):
    """Wraps any Keras 3 optimizer; each replica compresses its own gradient.

    Per step and replica: ``acc = residual + grad`` (with error feedback), the compressed
    payload of ``acc`` travels (sparse payloads by all-gather, summable ones by all-reduce), the
    inner optimizer applies the average over replicas of the decompressed payloads, and
    ``residual = acc - decompress(payload)``. Keras' own dense gradient all-reduce does not run.

    Args:
        inner_optimizer: the Keras optimizer that applies the averaged update (its learning
            rate, schedule, clipping, weight decay, EMA, accumulation and loss scale factor
            work as usual and act on that update).
        compressor: a :class:`~tf_sparsify.compressors.Compressor`.
        **kwargs: how gradients are exchanged: the fields of
            :class:`~tf_sparsify.core.options.ExchangeOptions` (``error_feedback``, ``scope``,
            ``min_size``, ``skip_1d``, ``momentum_correction``, ``local_clipnorm``,
            ``bucket_bytes``). With ``momentum_correction`` momentum happens on each replica
            before compression, so the inner optimizer must not add its own: an inner ``SGD``
            with ``momentum > 0`` is rejected, other inner optimizers get a warning; momentum
            buffers are per-replica optimizer variables like the residuals.
        diagnostics_every: every this many steps, record the norm gap, residual norm and
            density of the step in ``diagnostics`` (0 = off; the
            :class:`~tf_sparsify.keras.CompressionDiagnostics` callback turns it on itself).
        transport: how payloads travel (:class:`~tf_sparsify.core.transport.Transport`): ``None``
            is tf.distribute's replica context (one replica outside strategies); Horovod's
            :class:`~tf_sparsify.horovod.DistributedOptimizer` is this wrapper with a
            :class:`~tf_sparsify.horovod.HorovodTransport`.

    With a plain ``keras.optimizers.SGD`` inside (no momentum, weight decay, clipping, EMA, loss
    scale factor or accumulation), outside ``tf.distribute`` strategies and XLA and without a
    GPU, the updates of TopK-compressed variables go into the variables in place from the gathered
    entries (:mod:`tf_sparsify.keras.sparse_sgd`): the dense update is never built.

    Residuals are optimizer variables (checkpointed, saved in ``.keras`` files). Under a
    ``tf.distribute`` strategy each replica keeps its own residual (sync-on-read). Keras'
    saving (``.keras``, ``.weights.h5``, ``BackupAndRestore``) stores each replica's residual
    and restores it exactly (:mod:`tf_sparsify.core.replica_values`); in a ``tf.train.Checkpoint``
    the optimizer is one named, validated entry holding every replica's rows
    (:mod:`tf_sparsify.core.checkpoint`), restored exactly. Under
    ``MultiWorkerMirroredStrategy``, ``model.fit`` works (:mod:`tf_sparsify.keras.multi_worker`)
    and every worker saves its own residuals. Non-finite
    gradients never enter the residuals; see :mod:`tf_sparsify.core.pipeline`.

    The inner optimizer's options (``weight_decay``, ``clipnorm``, ``use_ema``,
    ``loss_scale_factor``, ...) read and write through the wrapper, and
    ``exclude_from_weight_decay`` reaches it, so Keras wrappers and callbacks around this one
    (``LossScaleOptimizer``, ``MultiOptimizer``, ``SwapEMAWeights``) act on the inner optimizer.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        compressor: Compressor,
        name: str | None = None,
        diagnostics_every: int = 0,
        transport: Transport | None = None,
        **kwargs: Any,
    ):
        options = ExchangeOptions.take(kwargs)
        inner_options.refuse(kwargs, "SparsifiedOptimizer")
        if kwargs:
            raise ValueError(f"SparsifiedOptimizer got unknown arguments: {sorted(kwargs)}")
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "`inner_optimizer` must be a keras.optimizers.Optimizer; "
                f"received inner_optimizer={inner_optimizer!r}"
            )
        super().__init__(learning_rate=0.0, name=name)
        multi_worker.install()
        auto_jit.install()
        self.inner_optimizer = inner_optimizer
        pipeline = GradientPipeline(compressor, options)
        if pipeline.options.momentum_correction > 0:
            _check_no_inner_momentum(inner_optimizer)
        self._state = CompressionState(
            pipeline,
            self._make_variable,
            transport,
            step=keras_private.iterations_variable(self),
            also_saved=self._optimizer_entries,
        )
        self.enable_diagnostics(diagnostics_every)

    # -- state --------------------------------------------------------------------------------
    @keras_private.no_automatic_dependency_tracking
    def build(self, var_list):
        self._state.build(var_list)
        self.inner_optimizer.build(var_list)
        wrapped.skip_gradient_all_reduce(self.inner_optimizer)
        # Keras' build would also make EMA and accumulator variables for the options read
        # through to the inner optimizer, which keeps its own: only index the variables here.
        keras_private.index_variables(self, var_list)
        self.built = True
        self._state.checkpoint.build()  # a restore that came first

    def set_compressor(self, compressor: Compressor) -> None:
        """Use ``compressor`` from the next trace of the train step on (e.g. a new density).

        Everything else (error feedback, scope, sizes, heuristics) stays; residuals and momenta
        carry over. The plan and the byte counts are recomputed, so the statistics stay
        truthful once the step is retraced (``model.make_train_function(force=True)``). Under
        Horovod every rank must make the same change (a rank that does not fails by name).
        """
        variables = keras_private.trainable_variables(self) if self.built else None
        self._state.set_pipeline(self.pipeline.with_compressor(deserialize(compressor)), variables)

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """As on the inner optimizer, which applies the weight decay."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    # -- one step -----------------------------------------------------------------------------
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `variables`, the optimizer must already be "
                    "built: call `optimizer.build(trainable_variables)` first."
                )
            variables = None
        else:
            variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(variables)
            keras_private.check_variables_are_known(self, variables)
        built_for = keras_private.trainable_variables(self)
        ordered = self._in_build_order(grads, variables)
        # Keras' checks: "No gradients provided" for all-None, a warning for some None.
        keras_private.check_gradients(self, grads, variables or built_for)
        self._apply_in_build_order(ordered)

    def apply_in_flight(self) -> None:
        """Apply the update still in flight with ``late_buckets`` (the late units' last
        gradients): one step with zero gradients for the late variables and none for the
        others. ``fit`` calls it when it ends; a custom loop calls it after its last step, in
        a replica context as its steps (``strategy.run``). Nothing happens without late
        buckets; a second call applies zeros."""
        if self.built and any(self._state.late):
            built_for = keras_private.trainable_variables(self)
            flush = late.flush_gradients(self._state.late, built_for)
            self._apply_in_build_order(flush, flush=True)

    def _apply_in_build_order(self, ordered: list, flush: bool = False) -> None:
        """One step on gradients aligned with the built variables (``None``: no gradient);
        ``flush``: the step applies what is in flight."""
        built_for = keras_private.trainable_variables(self)
        # A LossScaleOptimizer inside scales the gradients by its dynamic scale, which changes
        # between steps: exchange in gradient units so the residuals never mix scales, and hand
        # it the update scaled back (exact: the scale is a power of two).
        scale = _dynamic_loss_scale(self.inner_optimizer)
        if scale is not None:
            ordered = [None if g is None else _times(g, 1.0 / scale) for g in ordered]
        with keras.name_scope(self.name, caller=self):
            result = self.compression_step(ordered, self.collective(ordered, flush))
        updates = result.updates
        if scale is not None:
            updates = [None if u is None else _times(u, scale) for u in updates]
        pairs = [(u, v) for u, v in zip(updates, built_for, strict=True) if u is not None]
        dense = [(u, v) for u, v in pairs if not isinstance(u, SparseUpdate)]
        sparse = [(u, v) for u, v in pairs if isinstance(u, SparseUpdate)]
        if sparse:
            sparse_sgd.apply(self.inner_optimizer, sparse, count_step=not dense)
        if dense:
            self.inner_optimizer.apply([u for u, _ in dense], [v for _, v in dense])

    def update_step(self, gradient, variable, learning_rate):
        raise NotImplementedError(
            "SparsifiedOptimizer updates only through apply()/apply_gradients(): a step's "
            "gradients are exchanged together before the inner optimizer's update_step runs."
        )

    @property
    def runs_under_xla(self) -> bool:
        """Whether XLA can compile a step of this optimizer (Keras' ``jit_compile="auto"``
        resolves to ``False`` where it cannot: :mod:`tf_sparsify.keras.auto_jit`)."""
        return self.compressor.runs_under_xla and self.transport.runs_under_xla

    def collective(self, grads: list | None = None, flush: bool = False) -> Collective:
        """How a step's payloads travel: the transport's collective for a step on ``grads``
        (in build order; ``None``: every variable has a gradient); ``flush``: the step applies
        what is in flight."""
        return self._state.collective(grads, flush)

    def compression_step(self, grads: list, collective: Collective) -> StepResult:
        """Compress the gradients (in build order), send the payloads through ``collective``
        and combine what arrives: the step of the compression state that :meth:`apply` hands
        on to the inner optimizer (residuals, momenta, counters and diagnostics are updated).
        Updates of TopK-compressed variables come as
        :class:`~tf_sparsify.core.pipeline.SparseUpdate` when the inner optimizer is plain SGD
        (:func:`~tf_sparsify.keras.sparse_sgd.applies_in_place`)."""
        sparse = self._state.gives_sparse_updates and sparse_sgd.applies_in_place(
            self.inner_optimizer, keras_private.trainable_variables(self)
        )
        return self._state.run(grads, collective, sparse_updates=sparse)

    def exchange(self, grads: list, collective: Collective) -> StepResult:
        """Deprecated: the old name of :meth:`compression_step` (removed in tf_sparsify 0.3)."""
        warnings.warn(
            "`SparsifiedOptimizer.exchange` is now `compression_step`; the old name will be "
            "removed in tf_sparsify 0.3.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.compression_step(grads, collective)

    def _in_build_order(self, grads: list, variables: list | None) -> list:
        count = len(keras_private.trainable_variables(self))
        if variables is None:
            if len(grads) != count:
                raise ValueError(f"Expected {count} gradients, received {len(grads)}.")
            return grads
        ordered = [None] * count
        for g, v in zip(grads, variables, strict=True):
            ordered[keras_private.variable_index(self, v)] = g
        return ordered

    # -- serialization ------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        config = self.pipeline.get_config()
        if self.diagnostics_every:
            config["diagnostics_every"] = self.diagnostics_every
        config["inner_optimizer"] = keras.saving.serialize_keras_object(self.inner_optimizer)
        config["name"] = self.name
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects=None) -> SparsifiedOptimizer:
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        compressor = deserialize(config.pop("compressor"))
        return cls(inner, compressor, **config)


def _dynamic_loss_scale(optimizer) -> tf.Tensor | None:
    """The dynamic scale of a LossScaleOptimizer in the wrapper chain below, if any."""
    loss_scale = wrapped.find(optimizer, keras.optimizers.LossScaleOptimizer)
    return None if loss_scale is None else tf.convert_to_tensor(loss_scale.dynamic_scale)


def _times(tensor, factor: tf.Tensor) -> tf.Tensor | tf.IndexedSlices:
    """``tensor * factor``; ``IndexedSlices`` stay sparse."""
    if isinstance(tensor, tf.IndexedSlices):
        return tf.IndexedSlices(_times(tensor.values, factor), tensor.indices, tensor.dense_shape)
    tensor = tf.convert_to_tensor(tensor)
    return tensor * tf.cast(factor, tensor.dtype)


def _check_no_inner_momentum(optimizer) -> None:
    """Momentum correction already applies momentum: the inner optimizer must not add more."""
    inner = wrapped.innermost(optimizer)
    if isinstance(inner, keras.optimizers.SGD):
        if inner.momentum:
            raise ValueError(
                "momentum_correction applies momentum on each replica before compression; the "
                f"inner SGD must have momentum=0, received momentum={inner.momentum!r}."
            )
        return
    warnings.warn(
        f"momentum_correction is meant for a plain SGD inner optimizer; {type(inner).__name__} "
        "will apply its own update rule to the momentum-corrected updates.",
        stacklevel=3,
    )
