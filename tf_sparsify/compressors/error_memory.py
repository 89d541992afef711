"""Error memory: each unit's state record, and the rules that read and write it.

Every front end keeps, per planned unit and replica, a :class:`UnitMemory`: the error-feedback
residual, the DGC momentum buffer and the compressor's own state (PowerSGD's warm start). This
module owns the rules of that state, in the order a step applies them:

1. momentum correction (DGC, Lin et al. 2018, section 3.1): ``u = m * u + g``, and ``u`` is
   compressed in place of ``g`` (:func:`accumulate_momentum`);
2. error feedback (Stich et al. 2018): ``acc = x + e`` is compressed and
   ``e' = acc - decompress(payload)`` is what was not sent (``Codec.compress_with_feedback``;
   compressors with a fused kernel do both in one pass, TopK's ``compress_compensated``);
3. momentum factor masking: the momentum of the entries sent is dropped,
   ``u' = u * (1 - sent)`` (:func:`mask_momentum`), so stale momentum is not carried on;
4. the non-finite policy: what a replica keeps is written only when the whole step was finite
   on every replica (the state core's write-back), so NaN or Inf never enter the memory
   and nothing already in it is lost; a replica whose kept state would be non-finite marks
   its payload (see :mod:`tf_sparsify.core.pipeline`), so every replica agrees.

Compressors that run their own exchange (PowerSGD, SparseAllReduce) compute ``e'`` inside their
protocol, by the same definition. At density 1 everything is sent: ``e' = 0``, the masking
resets ``u`` and the rule is plain (momentum) SGD.

How the records are stored is the state core's business
(:class:`~tf_sparsify.core.state.CompressionState`), which also writes them back by rule 4.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import tensorflow as tf

from tf_sparsify.common.finite import all_finite, mark_non_finite


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


def mask_momentum(buffer: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
    """``u`` with the sent entries (``mask > 0``, from the compressor's ``sent_mask``) set to
    zero."""
    return tf.where(mask > 0, tf.zeros_like(buffer), buffer)


def after_sending(
    compressed: tf.Tensor,
    remainder: tf.Tensor | None,
    sent_mask: Callable[[], tf.Tensor],
    with_momentum: bool,
) -> UnitMemory:
    """What a replica keeps once ``compressed`` (``g``, or ``u`` under momentum correction)
    went out: the remainder, and the momentum masked where entries were sent (``sent_mask()``,
    the compressor's mask of its payload; unmasked for units without error feedback, whose
    momentum is plain momentum SGD's)."""
    momentum = None
    if with_momentum:
        momentum = compressed
        if remainder is not None:
            momentum = mask_momentum(compressed, sent_mask())
    return UnitMemory(remainder, momentum)


def kept_tensors(memory: UnitMemory) -> list[tf.Tensor]:
    """The float tensors of a record that the memory would keep."""
    return [t for t in (memory.residual, memory.momentum) if t is not None]


def mark_if_kept_non_finite(
    payload: tuple[tf.Tensor, ...], after: UnitMemory
) -> tuple[tf.Tensor, ...]:
    """``payload`` with NaN added to its float tensors when what the replica keeps would be
    non-finite: every replica then sees the bad step in the payloads and agrees on it."""
    kept = kept_tensors(after)
    if not kept:
        return payload
    ok = tf.reduce_all(tf.stack([all_finite(t) for t in kept]))
    return tuple(mark_non_finite(t, ok) if t.dtype.is_floating else t for t in payload)
