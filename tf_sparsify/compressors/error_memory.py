"""Error memory: each unit's state record, and the rules that read and write it.

Every front end keeps, per planned unit and replica, a :class:`UnitMemory`: the error-feedback
residual, the DGC momentum buffer and the compressor's own state (PowerSGD's warm start). This
module owns the rules of that state, in the order a step applies them:

1. momentum correction (DGC, Lin et al. 2018, section 3.1): ``u = m * u + g``, and ``u`` is
   compressed in place of ``g`` (:func:`accumulate_momentum`);
2. error feedback (Stich et al. 2018): ``acc = x + e`` is compressed and
   ``e' = acc - decompress(payload)`` is what was not sent (:func:`compress_with_feedback`;
   compressors with a fused kernel do both in one pass, TopK's ``compress_compensated``);
3. momentum factor masking: the momentum of the entries sent is dropped,
   ``u' = u * (1 - sent)`` (:func:`mask_momentum`), so stale momentum is not carried on;
4. the non-finite policy: what a replica keeps is written only when the whole step was finite
   on every replica (:func:`store_if_finite`), so NaN or Inf never enter the memory and nothing
   already in it is lost; a replica whose kept state would be non-finite marks its payload
   (see :mod:`tf_sparsify.core.pipeline`), so every replica agrees.

Compressors that run their own exchange (PowerSGD, SparseAllReduce) compute ``e'`` inside their
protocol, by the same definition. At density 1 everything is sent: ``e' = 0``, the masking
resets ``u`` and the rule is plain (momentum) SGD.

How the records are stored is the front end's choice (:data:`Kind`, :data:`VariableFactory`):
Keras optimizer variables (per replica under ``tf.distribute``) or ``tf.Variable``s of a
``tf.Module``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import tensorflow as tf

from tf_sparsify.core import replica_values

if TYPE_CHECKING:
    from tf_sparsify.compressors.base import Compressor, Context, Payload

#: ``"per_replica"``: each replica writes its own copy, summed when read across replicas
#: (residuals, momenta); ``"per_replica_mean"``: the same, averaged (diagnostics);
#: ``"replicated"``: each replica writes its own, identical copy (a custom exchange's state,
#: agreed through its collectives; read as the first replica's); ``"shared"``: one value
#: (counters; the first replica's).
Kind = Literal["per_replica", "per_replica_mean", "replicated", "shared"]
#: ``make_variable(name, shape, dtype, kind)``: a zero variable, tracked by the front end.
VariableFactory = Callable[[str, tuple[int, ...], tf.DType, Kind], Any]


class UnitMemory(NamedTuple):
    """One unit's memory on one replica (its variables' tensors joined when it has several)."""

    #: the error-feedback residual ``e`` (``None``: the unit has no error feedback)
    residual: tf.Tensor | None = None
    #: the DGC momentum buffer ``u`` (``None``: no momentum correction)
    momentum: tf.Tensor | None = None
    #: the compressor's own state (see ``Compressor.state_specs``)
    compressor_state: tuple[tf.Tensor, ...] = ()


def accumulate_momentum(buffer: tf.Tensor, grad: tf.Tensor, factor: float) -> tf.Tensor:
    """``u = m * u + g``: the tensor compressed in place of ``g`` under momentum correction."""
    return tf.constant(factor, grad.dtype) * buffer + grad


def compress_with_feedback(
    compressor: Compressor,
    tensor: tf.Tensor,
    residual: tf.Tensor,
    step: tf.Tensor | int | None = None,
    tensor_id: int = 0,
    replica_id: tf.Tensor | int = 0,
) -> tuple[Payload, Context, tf.Tensor]:
    """Compress ``acc = tensor + residual``: ``(payload, ctx, acc - decompress(payload))``, in
    one pass where the compressor has a fused kernel (``fuses_feedback``)."""
    if compressor.fuses_feedback:
        return compressor.compress_compensated(tensor, residual, step, tensor_id, replica_id)
    acc = tf.convert_to_tensor(tensor) + residual
    payload, ctx = compressor.compress(acc, step, tensor_id, replica_id)
    return payload, ctx, acc - compressor.decompress(payload, ctx)


def mask_momentum(buffer: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
    """``u`` with the sent entries (``mask > 0``, from the compressor's ``sent_mask``) set to
    zero."""
    return tf.where(mask > 0, tf.zeros_like(buffer), buffer)


def after_sending(
    compressor: Compressor,
    compressed: tf.Tensor,
    remainder: tf.Tensor | None,
    payload: Payload,
    ctx: Context,
    with_momentum: bool,
) -> UnitMemory:
    """What a replica keeps once ``compressed`` (``g``, or ``u`` under momentum correction)
    went out as ``payload``: the remainder, and the momentum masked where entries were sent
    (unmasked for units without error feedback, whose momentum is plain momentum SGD's)."""
    momentum = None
    if with_momentum:
        momentum = compressed
        if remainder is not None:
            momentum = mask_momentum(compressed, compressor.sent_mask(payload, ctx))
    return UnitMemory(remainder, momentum)


def kept_tensors(memory: UnitMemory) -> list[tf.Tensor]:
    """The float tensors of a record that the memory would keep."""
    return [t for t in (memory.residual, memory.momentum) if t is not None]


def mark_non_finite(tensor: tf.Tensor, ok: tf.Tensor) -> tf.Tensor:
    """``tensor`` unchanged when ``ok``, all NaN otherwise (so a later check sees the bad step)."""
    return tensor + tf.cast(tf.where(ok, 0.0, float("nan")), tensor.dtype)


def mark_if_kept_non_finite(payload: Payload, after: UnitMemory) -> Payload:
    """``payload`` with NaN added to its float tensors when what the replica keeps would be
    non-finite: every replica then sees the bad step in the payloads and agrees on it."""
    kept = kept_tensors(after)
    if not kept:
        return payload
    ok = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in kept]))
    return tuple(mark_non_finite(t, ok) if t.dtype.is_floating else t for t in payload)


def store_if_finite(pairs: Sequence[tuple[Any, tf.Tensor]], finite: tf.Tensor) -> None:
    """Assign each ``(variable, new value)`` pair only when ``finite`` (the step was finite on
    every replica): a bad step leaves the memory as it was. A value given as
    ``tf.IndexedSlices`` writes only its rows (a sparse gradient's touched rows)."""
    if not pairs:
        return

    def store() -> tf.Tensor:
        for variable, value in pairs:
            if isinstance(value, tf.IndexedSlices):
                replica_values.write_rows(variable, value)
            else:
                variable.assign(value)
        return tf.constant(True)

    tf.cond(finite, store, lambda: tf.constant(False))
