"""Local gradient clipping before accumulation (DGC, Lin et al. 2018, section 3.2).

With error feedback, what a replica adds to its residual must be clipped *before* it is
accumulated: clipping the averaged update afterwards would not bound the residual. DGC clips each
replica's gradient by its norm with the threshold scaled by ``1/sqrt(num_replicas)``, so that the
sum of ``num_replicas`` roughly orthogonal contributions has norm about ``clipnorm``.

Here ``clipnorm`` refers to the averaged update the inner optimizer applies. A replica's gradient
enters that update as ``grad / divisor`` (Keras under tf.distribute: ``divisor == 1``, each
replica's loss is already scaled by ``1/num_replicas``; Horovod: ``divisor == num_replicas``), so
the threshold on the replica's raw gradient is ``clipnorm * divisor / sqrt(num_replicas)``.
With one replica this is ordinary clipping by global norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import tensorflow as tf

from tf_sparsify.common.checks import check_number


def check_clipnorm(clipnorm) -> float | None:
    """``None`` (off) or a positive finite number."""
    if clipnorm is None:
        return None
    check_number("local_clipnorm", clipnorm, 0, low_open=True)
    return float(clipnorm)


def local_clip_threshold(clipnorm: float, num_replicas: int = 1, divisor: float = 1.0) -> float:
    """The norm bound on one replica's raw gradient: ``clipnorm * divisor / sqrt(replicas)``."""
    return float(clipnorm) * float(divisor) / math.sqrt(max(int(num_replicas), 1))


def clip_by_local_norm(
    grads: Sequence[tf.Tensor | None],
    clipnorm: float,
    num_replicas: int = 1,
    divisor: float = 1.0,
) -> list[tf.Tensor | None]:
    """Scale all gradients of this replica together so their joint L2 norm is at most the
    :func:`local_clip_threshold`. ``None`` entries pass through; a non-finite norm makes every
    gradient non-finite (so the pipeline's non-finite policy sees the bad step).
    """
    threshold = local_clip_threshold(clipnorm, num_replicas, divisor)
    present = [tf.convert_to_tensor(g) for g in grads if g is not None]
    if not present:
        return list(grads)
    # float32 sums (float64 when a gradient is float64), so half-precision gradients cannot overflow
    wide = tf.float64 if any(g.dtype == tf.float64 for g in present) else tf.float32
    norm = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, wide))) for g in present]))
    threshold = tf.constant(threshold, wide)
    # min(1, t / norm), written so that norm == 0 gives 1 and a NaN/Inf norm gives NaN.
    scale = tf.where(norm > threshold, threshold / norm, tf.ones_like(norm))
    scale = tf.where(tf.math.is_finite(norm), scale, tf.constant(float("nan"), wide))
    return [None if g is None else tf.convert_to_tensor(g) * tf.cast(scale, g.dtype) for g in grads]
