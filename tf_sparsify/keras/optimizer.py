"""``SparsifiedOptimizer``: a Keras 3 optimizer that compresses gradients before they travel."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras import initializers
from keras.src import backend
from keras.src.saving import serialization_lib
from keras.src.utils import tracking

from tf_sparsify.collectives import Collective, current_collective
from tf_sparsify.compressors.base import Compressor, deserialize
from tf_sparsify.pipeline import GradientPipeline, StepResult, bytes_per_step

_BASE_OPTIONS = (
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


@keras.saving.register_keras_serializable(package="tf_sparsify")
class SparsifiedOptimizer(keras.optimizers.Optimizer):
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
        error_feedback: keep residuals; default on for biased compressors, off for unbiased.
        scope: ``"layer"`` (per tensor) or ``"global"`` (all tensors of a dtype together).
        min_size: tensors with fewer entries travel uncompressed.

    Residuals are optimizer variables (checkpointed, saved in ``.keras`` files). Under a
    ``tf.distribute`` strategy each replica keeps its own residual (sync-on-read, summed when
    saved and split evenly when restored: the total error mass is conserved). Non-finite
    gradients never enter the residuals; see :mod:`tf_sparsify.pipeline`.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        compressor: Compressor,
        error_feedback: bool | None = None,
        scope: str = "layer",
        min_size: int = 0,
        name: str | None = None,
        **kwargs: Any,
    ):
        for option in _BASE_OPTIONS:
            if kwargs.pop(option, None) not in (None, False, 0.99):
                raise ValueError(
                    f"SparsifiedOptimizer does not take `{option}`: set it on the inner optimizer, "
                    "where it acts on the averaged, decompressed update."
                )
        if kwargs:
            raise ValueError(f"SparsifiedOptimizer got unknown arguments: {sorted(kwargs)}")
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "`inner_optimizer` must be a keras.optimizers.Optimizer; "
                f"received inner_optimizer={inner_optimizer!r}"
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.pipeline = GradientPipeline(compressor, error_feedback, scope, min_size)
        self._units = []
        self._residuals = []

    @property
    def compressor(self) -> Compressor:
        return self.pipeline.compressor

    # -- state --------------------------------------------------------------------------------
    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        self._units = self.pipeline.plan([v.shape for v in var_list], [v.dtype for v in var_list])
        needs = self.pipeline.needs_residual(self._units, len(var_list))
        self._residuals = [
            self._add_residual(v) if need else None for v, need in zip(var_list, needs, strict=True)
        ]
        self.wire_bytes_per_step, self.dense_bytes_per_step = bytes_per_step(self._units)
        self.bytes_sent = self.add_variable(
            (), dtype="int64", aggregation="only_first_replica", name="bytes_sent"
        )
        self.dense_bytes = self.add_variable(
            (), dtype="int64", aggregation="only_first_replica", name="dense_bytes"
        )
        self.inner_optimizer.build(var_list)
        _disable_dense_all_reduce(self.inner_optimizer)
        super().build(var_list)

    def _add_residual(self, variable) -> backend.Variable:
        """A zero residual per replica (sync-on-read: each replica writes only its own copy)."""
        with backend.name_scope(self.name, caller=self):
            residual = backend.Variable(
                initializer=initializers.Zeros(),
                shape=variable.shape,
                dtype=variable.dtype,
                trainable=False,
                aggregation="sum",
                synchronization="on_read",
                name=f"{variable.name}_residual",
            )
        self._track_variable(residual)
        return residual

    @property
    def residuals(self) -> list:
        """The residual variable of each trainable variable (``None`` where there is none)."""
        return list(self._residuals)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- one step -----------------------------------------------------------------------------
    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with backend.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
            self.built = True
        variables = list(trainable_variables) if trainable_variables is not None else None
        ordered = self._in_build_order(list(grads), variables)
        result = self.exchange(ordered, current_collective())
        with backend.name_scope(self.name, caller=self):
            self._write_residuals(result)
            self.bytes_sent.assign_add(self.wire_bytes_per_step)
            self.dense_bytes.assign_add(self.dense_bytes_per_step)
            self._iterations.assign_add(1)
        pairs = [
            (u, v)
            for u, v in zip(result.updates, self._trainable_variables, strict=True)
            if u is not None
        ]
        if pairs:
            self.inner_optimizer.apply([u for u, _ in pairs], [v for _, v in pairs])

    def exchange(self, grads: list, collective: Collective) -> StepResult:
        """Run the pipeline on gradients in build order, with this step's RNG key."""
        residuals = [None if r is None else r.value for r in self._residuals]
        return self.pipeline.step(self._units, grads, residuals, self._iterations, collective)

    def _in_build_order(self, grads: list, variables: list | None) -> list:
        if variables is None:
            if len(grads) != len(self._trainable_variables):
                raise ValueError(
                    f"Expected {len(self._trainable_variables)} gradients, received {len(grads)}."
                )
            return grads
        ordered = [None] * len(self._trainable_variables)
        for g, v in zip(grads, variables, strict=True):
            ordered[self._get_variable_index(v)] = g
        return ordered

    def _write_residuals(self, result: StepResult) -> None:
        """Store the new residuals only when the whole step was finite everywhere."""
        pairs = [
            (r, new)
            for r, new in zip(self._residuals, result.residuals, strict=True)
            if r is not None and new is not None
        ]
        if not pairs:
            return

        def store():
            for r, new in pairs:
                r.assign(new)
            return tf.constant(True)

        tf.cond(result.finite, store, lambda: tf.constant(False))

    # -- serialization ------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        config = self.pipeline.get_config()
        config["inner_optimizer"] = serialization_lib.serialize_keras_object(self.inner_optimizer)
        config["name"] = self.name
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects=None) -> SparsifiedOptimizer:
        config = dict(config)
        inner = serialization_lib.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        compressor = deserialize(config.pop("compressor"))
        return cls(inner, compressor, **config)


def find_sparsified(optimizer) -> SparsifiedOptimizer | None:
    """The SparsifiedOptimizer in a chain of wrappers (e.g. under a LossScaleOptimizer)."""
    while optimizer is not None:
        if isinstance(optimizer, SparsifiedOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def _pass_through(grads_and_vars):
    return list(grads_and_vars)


def _disable_dense_all_reduce(optimizer) -> None:
    """Turn off the dense gradient all-reduce of Keras' TF optimizers down a wrapper chain.

    The TF backend all-reduces gradients inside ``apply`` when a replica context is active;
    the update we hand on is already the cross-replica average, so that reduction must not
    run. The inner chain belongs to the wrapper, so this is done once, at build.
    """
    while optimizer is not None:
        optimizer._all_reduce_sum_gradients = _pass_through
        optimizer = getattr(optimizer, "inner_optimizer", None)
