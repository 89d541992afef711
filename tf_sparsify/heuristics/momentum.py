"""Momentum correction with momentum factor masking (DGC, Lin et al. 2018, section 3.1).

Each replica keeps a momentum buffer ``u`` next to its residual ``v`` and, per step::

    u = m * u + g          # accumulate_momentum
    v = v + u              # the pipeline's error feedback, with u in place of g
    send C(v)              # e.g. TopK
    v = v - C(v)           # zero where sent (the usual residual)
    u = u * (1 - sent)     # mask_momentum: stale momentum is not carried on for sent entries

The inner optimizer must then be plain SGD without momentum (the momentum already happened on
the replica). At density 1 everything is sent every step and the masking resets ``u``: the rule
degenerates to plain SGD, as in DGC. Tensors that travel without error feedback (small or 1-D
ones) just keep the local momentum ``u = m * u + g`` and send ``C(u)``, unmasked: for dense
tensors that is exactly momentum SGD.
"""

from __future__ import annotations

import math

import tensorflow as tf


def check_momentum(momentum) -> float:
    """A momentum factor in ``[0, 1)``; 0 means off."""
    if (
        isinstance(momentum, bool)
        or not isinstance(momentum, int | float)
        or not math.isfinite(momentum)
        or not 0 <= momentum < 1
    ):
        raise ValueError(
            "`momentum_correction` must be a number in [0, 1); "
            f"received momentum_correction={momentum!r}"
        )
    return float(momentum)


def accumulate_momentum(buffer: tf.Tensor, grad: tf.Tensor, momentum: float) -> tf.Tensor:
    """``m * u + g``."""
    return tf.constant(momentum, grad.dtype) * buffer + grad


def mask_momentum(buffer: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
    """``u`` with the sent entries (``mask > 0``, from the compressor's ``sent_mask``) set to
    zero."""
    return tf.where(mask > 0, tf.zeros_like(buffer), buffer)
