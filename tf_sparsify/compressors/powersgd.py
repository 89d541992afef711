"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): a rank-r approximation of each
gradient matrix from one step of power iteration, warm-started across steps, with error
feedback. Its two factors are all-reduced, so the bytes per replica do not grow with the
number of replicas."""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from tf_sparsify.common.checks import check_int, check_seed
from tf_sparsify.common.dtypes import dtype_bytes
from tf_sparsify.compressors.base import Context, MultiRoundMethod, rng_seed
from tf_sparsify.compressors.error_memory import mark_non_finite
from tf_sparsify.compressors.rounds import SUM, Outcome, ReplicaGroup, Rounds, Transfer, scaled
from tf_sparsify.ops import xla


class PowerSGD(MultiRoundMethod):
    """Rank-``rank`` PowerSGD with warm start and error feedback.

    A tensor of shape ``[..., c]`` is the matrix ``M`` of shape ``[n, m] = [prod(shape[:-1]),
    c]`` (a Keras kernel ``[in, out]`` as it is, a convolution kernel ``[kh, kw, in, out]`` as
    ``[kh * kw * in, out]``), with ``M = x + e`` under error feedback. Per step and replica:

    1. ``P = M Q``, where ``Q`` (``[m, rank]``, the state) is the previous step's; a column
       of ``Q`` that is all zero (all of them at first) is drawn standard normal from
       ``(seed, step, tensor)``, the same on every replica;
    2. ``P`` is summed over replicas and its columns made orthonormal (Gram-Schmidt, twice;
       a zero column stays zero): ``P^``. Every replica does this on the same sum;
    3. ``Q_r = M^T P^`` is summed over replicas: ``S``;
    4. update ``= P^ S^T / divisor``: ``P^ P^^T`` projects the sum of the replicas' ``M``,
       so the update approximates their mean (Horovod) or sum (Keras, whose losses are
       already divided by the replica count);
    5. residual ``e = M - P^ Q_r^T`` (the paper's Algorithm 2: this replica's own
       approximation, an orthogonal projection of ``M``, so ``||e|| <= ||M||``); the new
       state is ``S / replicas``.

    Conserved exactly (up to rounding): ``divisor * update + sum_r e_r = sum_r M_r`` each
    step, since the projections of the replicas' matrices add up to the projection of their
    sum. Each replica's residual differs from the others' by what its own ``M`` holds outside
    the shared subspace; PyTorch's hook keeps ``M - P^ S^T / replicas`` instead, with the same
    sum.

    Tensors of rank < 2, and matrices where ``rank * (n + m) >= n * m`` (low rank would not
    pay), are sent dense by one all-reduce of ``x + e`` and keep a zero residual. 16-bit
    gradients are factored and sent in float32 (the sums and Gram-Schmidt need its range); the
    residual and the update are computed in float32 and rounded once to the tensor's dtype.
    A step where either does not fit that dtype (a finite float16 accumulator near 65504 whose
    approximation, or the residual, lies beyond it) cannot be sent: it is a non-finite step on
    every replica, as for a non-finite gradient (:mod:`tf_sparsify.compressors.error_memory`): the
    residuals and
    ``Q`` are kept as they were, and the update is non-finite, so a ``LossScaleOptimizer``
    inside skips it. Nothing is rounded to Inf into a residual.

    Error feedback is on by default (PowerSGD is biased) and allowed without a contraction:
    the residual is a projection of the accumulator, never longer than it, although no
    ``delta > 0`` holds for every ``M`` (``M Q`` can vanish). Momentum correction does not
    apply (the paper applies momentum to the update: use the inner optimizer's), nor do
    ``scope="global"``, per-replica updates (``ServerOptimizer``, delayed updates) or
    simulated workers: replicas share one projection, so no replica's own contribution exists.
    """

    unbiased = False
    summable = False
    #: the first ``Q`` is drawn from ``(seed, step, tensor)``
    randomized = True
    shape_aware = True
    error_feedback_by_design = True
    #: a non-finite ``M`` makes ``P`` non-finite, and the summed ``P`` is shared
    reveals_non_finite = True

    def __init__(self, rank: int, seed: int = 0):
        self.rank = check_int("rank", rank)
        self.seed = check_seed(seed)

    # -- what is sent -------------------------------------------------------------------------
    def matrix_shape(self, shape: tf.TensorShape) -> tuple[int, int] | None:
        """``(n, m)`` of a tensor compressed as a matrix, ``None`` for one sent dense."""
        shape = tf.TensorShape(shape)
        if shape.rank is None or shape.rank < 2:
            return None
        n, m = math.prod(shape[:-1]), shape[-1]
        return (n, m) if self.rank * (n + m) < n * m else None

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        """A tensor known only by its size is a vector: sent dense."""
        return num_elements * dtype_bytes(dtype)

    def wire_bytes_for(self, shape: tf.TensorShape, dtype: tf.DType = tf.float32) -> int:
        """``rank * (n + m)`` values of ``P`` and ``Q`` (float32 for 16-bit tensors), or the
        dense tensor."""
        dims = self.matrix_shape(shape)
        if dims is None:
            return self.wire_bytes(tf.TensorShape(shape).num_elements(), dtype)
        return self.rank * sum(dims) * _work_dtype(dtype).size

    def state_specs(self, shape: tf.TensorShape, dtype: tf.DType) -> tuple[tuple, ...]:
        """``Q``, ``[m, rank]``, for a compressed matrix; nothing for a dense tensor."""
        dims = self.matrix_shape(shape)
        return () if dims is None else (((dims[1], self.rank), _work_dtype(dtype)),)

    # -- the exchange -------------------------------------------------------------------------
    def rounds(
        self,
        tensor: tf.Tensor,
        residual: tf.Tensor | None,
        state: tuple[tf.Tensor, ...],
        ctx: Context,
        replicas: ReplicaGroup,
    ) -> Rounds:
        acc = tensor if residual is None else tensor + residual
        dims = self.matrix_shape(acc.shape)
        if dims is None:
            return _dense(acc, residual is not None, replicas)
        want = (dims[1], self.rank)
        if [tuple(t.shape) for t in state] != [want]:
            raise ValueError(
                f"{self!r} keeps one Q of shape {want} for a tensor of shape {acc.shape} (see "
                f"state_specs); received a state of shapes {[tuple(t.shape) for t in state]}."
            )
        return self._low_rank(acc, residual is not None, state[0], ctx, replicas, dims)

    def _low_rank(
        self,
        acc: tf.Tensor,
        feedback: bool,
        q: tf.Tensor,
        ctx: Context,
        replicas: ReplicaGroup,
        dims: tuple[int, int],
    ) -> Rounds:
        matrix = tf.reshape(tf.cast(acc, q.dtype), dims)
        (p,) = yield Transfer(SUM, (tf.matmul(matrix, self._warm_start(q, ctx)),))
        p_hat = orthonormal_columns(p)
        mine = tf.matmul(matrix, p_hat, transpose_a=True)
        # 16-bit tensors: residual and update are computed in float32 and rounded once, so
        # each is Inf only where its own value overflows the tensor's dtype; such a step is bad.
        narrowing = q.dtype != acc.dtype
        remainder = None
        if feedback:
            remainder = _as_tensor(matrix - tf.matmul(p_hat, mine, transpose_b=True), acc)
            if narrowing:  # a residual that does not fit turns the summed Q_r non-finite
                mine = mark_non_finite(mine, tf.reduce_all(tf.math.is_finite(remainder)))
        (total,) = yield Transfer(SUM, (mine,))
        update = _as_tensor(
            scaled(tf.matmul(p_hat, total, transpose_b=True), replicas.divisor), acc
        )
        new_q = total / tf.cast(replicas.count, total.dtype)
        # the update is the same on every replica (made from the sums): shared when rounded
        shared = (p, total, update) if narrowing else (p, total)
        return Outcome(update, remainder, (new_q,), shared=shared)

    def _warm_start(self, q: tf.Tensor, ctx: Context) -> tf.Tensor:
        """``q`` with its all-zero columns drawn standard normal from ``(seed, step, tensor)``."""
        key = rng_seed(self.seed, ctx.step, ctx.tensor_id)
        fresh = xla.stateless_normal(q.shape, key, q.dtype)
        empty = tf.reduce_all(tf.equal(q, 0), axis=0, keepdims=True)
        return tf.where(empty, fresh, q)

    def get_config(self) -> dict[str, Any]:
        return {"rank": self.rank, "seed": self.seed}


def orthonormal_columns(p: tf.Tensor) -> tf.Tensor:
    """The columns of ``p`` made orthonormal in order by Gram-Schmidt, each projected out of
    the previous ones twice ("twice is enough"), scaled by its largest entry before its norm
    is taken (no overflow); a column that ends up zero stays zero."""
    columns: list[tf.Tensor] = []
    for i in range(p.shape[1]):
        v = p[:, i : i + 1]
        if columns:
            basis = tf.concat(columns, axis=1)
            for _ in range(2):
                v = v - tf.matmul(basis, tf.matmul(basis, v, transpose_a=True))
        v = v / _nonzero(tf.reduce_max(tf.abs(v)))
        columns.append(v / _nonzero(tf.norm(v)))
    return tf.concat(columns, axis=1)


def _nonzero(scale: tf.Tensor) -> tf.Tensor:
    return tf.where(scale > 0, scale, tf.ones_like(scale))


def _dense(acc: tf.Tensor, feedback: bool, replicas: ReplicaGroup) -> Rounds:
    """One all-reduce of the whole tensor; nothing is left over."""
    (total,) = yield Transfer(SUM, (acc,))
    remainder = tf.zeros_like(acc) if feedback else None
    return Outcome(scaled(total, replicas.divisor), remainder, shared=(total,))


def _work_dtype(dtype: tf.DType) -> tf.DType:
    """float32 for 16-bit tensors, else the tensor's dtype."""
    dtype = tf.as_dtype(dtype)
    return tf.float32 if dtype.size < 4 else dtype


def _as_tensor(product: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """A ``[n, m]`` product in ``like``'s shape and dtype."""
    return tf.cast(tf.reshape(product, like.shape), like.dtype)
