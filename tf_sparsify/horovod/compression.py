"""Objects for Horovod's own ``compression=`` argument (``hvd.allreduce``,
``hvd.grouped_allreduce``, ``hvd.DistributedGradientTape``).

Horovod calls ``compress(tensor) -> (tensor, ctx)`` on each rank, all-reduces the returned
tensor, and calls ``decompress(reduced, ctx)``. Only what survives a dense all-reduce fits
that hook: casts, and random-k with indices shared by all ranks. The math is
:mod:`tf_sparsify.compressors`'; non-float tensors pass through untouched.

No Horovod op takes bfloat16, so a bfloat16 payload travels as float32 (exactly: every
bfloat16 is a float32) and bfloat16 inputs come back as bfloat16. For error feedback and a
sparse all-gather that really saves bytes, use :class:`~tf_sparsify.horovod.DistributedOptimizer`
or :class:`~tf_sparsify.horovod.DistributedGradientTape` instead.
"""

from __future__ import annotations

import tensorflow as tf

from tf_sparsify.compressors import BF16, FP16, Compressor, Context, RandomK, TopK
from tf_sparsify.horovod.collective import reject_xla


class _Hook:
    """Adapts a summable one-tensor compressor to Horovod's compress/decompress shape."""

    def __init__(self, codec: Compressor):
        self.codec = codec

    def compress(self, tensor: tf.Tensor) -> tuple[tf.Tensor, Context | None]:
        reject_xla()  # Horovod's all-reduce of the result would fail under XLA
        tensor = tf.convert_to_tensor(tensor)
        if not tensor.dtype.is_floating:
            return tensor, None
        (payload,), ctx = self.codec.compress(tensor, self._step(), 0, 0)
        if payload.dtype == tf.bfloat16:
            payload = tf.cast(payload, tf.float32)
        return payload, ctx

    def decompress(self, tensor: tf.Tensor, ctx: Context | None) -> tf.Tensor:
        if ctx is None:
            return tensor
        return tf.cast(self.codec.decompress((tensor,), ctx), ctx.dtype)

    def _step(self) -> tf.Tensor | int:
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.codec!r})"


class FP16Compression(_Hook):
    """float32/float64 travel as float16 (halves the bytes); float16 and bfloat16 as
    :class:`~tf_sparsify.FP16` leaves them (bfloat16 then as float32, see the module)."""

    def __init__(self):
        super().__init__(FP16())


class BF16Compression(_Hook):
    """Rounds each rank's tensor to bfloat16, but moves float32: it saves no bytes for
    float32 tensors (float64 ones do travel in half the bytes).

    Horovod has no bfloat16 all-reduce, and the bit pattern cannot be summed as integers, so
    the rounded values travel as float32 and are summed in float32: the result is the average
    of the bfloat16-rounded contributions, computed without bfloat16 accumulation error. Its
    use is bfloat16 rounding under plain Horovod, and bfloat16 gradients (mixed precision),
    which Horovod would otherwise reject.
    """

    def __init__(self):
        super().__init__(BF16())


class RandomKCompression(_Hook, tf.Module):
    """Random-k with indices shared by all ranks: only ``k`` scaled values travel.

    Every rank picks the same ``k`` indices (from ``seed`` and a call counter), so the k-vectors
    can be all-reduced and scattered back: the result is the average of the ranks' unbiased
    random-k estimates (:class:`~tf_sparsify.RandomK`, scaled by d/k). The counter advances
    on every ``compress`` call, so indices change from tensor to tensor and step to step; all
    ranks must compress the same tensors in the same order (as Horovod's tape and
    optimizer do). It is a variable of this ``tf.Module``: checkpoint it to resume the same
    index sequence.
    """

    def __init__(self, ratio: float, seed: int = 0):
        tf.Module.__init__(self)
        _Hook.__init__(self, RandomK(ratio, seed))
        self.calls = tf.Variable(0, dtype=tf.int64, trainable=False, name="calls")

    def _step(self) -> tf.Tensor:
        return tf.convert_to_tensor(self.calls.assign_add(1))


class TopKCompression(_Hook):
    """Keeps each rank's k largest entries, as a dense tensor: it saves no bytes.

    A sum of sparse tensors with different supports is not sparse, so through an all-reduce
    the full dense tensor travels; and Horovod's hook keeps no memory, so there is no error
    feedback. It is here to study the effect of top-k sparsification under plain Horovod;
    for the bytes, use :class:`~tf_sparsify.horovod.DistributedOptimizer` (all-gather of
    values and indices, with error feedback).
    """

    def __init__(self, ratio: float | None = None, k: int | None = None):
        super().__init__(TopK(ratio=ratio, k=k))

    def compress(self, tensor: tf.Tensor) -> tuple[tf.Tensor, Context | None]:
        reject_xla()  # Horovod's all-reduce of the result would fail under XLA
        tensor = tf.convert_to_tensor(tensor)
        if not tensor.dtype.is_floating:
            return tensor, None
        payload, ctx = self.codec.compress(tensor)
        sparse = self.codec.decompress(payload, ctx)
        if sparse.dtype == tf.bfloat16:
            sparse = tf.cast(sparse, tf.float32)
        return sparse, ctx

    def decompress(self, tensor: tf.Tensor, ctx: Context | None) -> tf.Tensor:
        return tensor if ctx is None else tf.cast(tensor, ctx.dtype)
