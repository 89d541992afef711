"""Sparse gradients (``tf.IndexedSlices``, from embeddings) exchanged over the rows they touch.

An embedding's gradient touches the rows of the tokens in the batch: a few thousand rows of a
32k x 512 table. Densified, it would be a 16M-entry gradient, compressed, sent and kept as a
dense residual. Here a unit of one variable whose gradient is ``IndexedSlices`` travels as rows:

1. duplicate indices are combined first (their values summed), the touched rows sorted
   ascending (:func:`combined`);
2. ``Identity`` sends the touched rows as they are (plus their residual, with error feedback);
   ``FP16`` and ``BF16`` send them cast to the wire type, by the dense casts' fused op (the
   rounding error and any saturated excess stay in the touched rows' residual); ``TopK``
   selects ``k`` entries of ``acc = rows + residual[rows]``, with ``k`` from the ratio over the
   touched entries (``max(1, ceil(ratio * rows * row size))``, the same exact rule as
   :func:`~tf_sparsify.compressors.base.k_for`; a fixed ``k`` clamped to them), ties to the
   lowest flat index, NaN and Inf first, as the dense fused op;
3. every replica's rows travel by one all-gather of varying row counts (``GATHER_ROWS``: under
   tf.distribute padded to the largest count with a count prefix, under Horovod its grouped
   all-gather), so only touched rows move;
4. the update is ``IndexedSlices`` of the rows any replica sent (``Identity``, the casts, their
   values back in the variable's dtype) or the rows holding selected entries (``TopK``), a row
   several replicas sent summed, values divided by the divisor; the inner Keras optimizer then
   does its sparse update.

Residual of untouched rows: each variable keeps one residual buffer of its full shape (so
checkpoints hold what they held before). A step reads the residual of its touched rows only
(a gather) and writes back only those rows (a scatter into this replica's copy,
:func:`tf_sparsify.replica_values.write_rows`): a row's residual is what was not sent of it,
and the residual of a row the step does not touch waits unchanged (it is not a candidate for
TopK's selection) until the row is touched again. Nothing decays and nothing is lost, so
conservation holds exactly as on the dense path: the sum of the applied updates plus every
replica's residual equals the sum of the gradients. A step that is not finite on every replica
writes no rows (:func:`tf_sparsify.memory.store_if_finite`).

Duplicates are combined, on each replica and across replicas, before the inner optimizer sees
them, so it gets rows of the dense gradient (of the update, for a lossy compressor) and an
update that is not linear in the gradient gets what the dense gradient would give it: Keras'
Adam and Adagrad given raw ``IndexedSlices`` square each duplicate index apart (Keras' Adam
decays the moments of every row either way), so on an embedding plain Keras differs from
Keras on the densified gradient, and the wrapper equals the latter on every path.

Everything else densifies the gradient first, as before (:func:`keeps_rows`), losing no
gradient mass (the dense path's error feedback keeps the residual): other compressors (QSGD,
TernGrad and ScaledSign sum payloads of one dense layout by all-reduce; RandomK's shared
indices and PowerSGD's factors span the whole tensor; the sparse all-reduce splits the whole
index range; a subclass of Identity, the casts or TopK may change what they send), momentum
correction (the buffer decays every row each step), local clipping, diagnostics, per-replica
contributions (delayed updates, IAG), simulated workers, units of several variables
(``scope="global"``), XLA (row counts depend on the data) and collectives without an all-gather
of varying row counts (the hierarchical Horovod exchange).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_sparsify import ops, replica_values
from tf_sparsify.compressors.base import Compressor, decimal_ratio
from tf_sparsify.compressors.dense import BF16, FP16, Identity, saturating_cast
from tf_sparsify.compressors.protocol import (
    GATHER_ROWS,
    Opening,
    Outcome,
    Protocol,
    Replicas,
    Transfer,
    scaled,
)
from tf_sparsify.compressors.topk import TopK
from tf_sparsify.memory import UnitMemory


def handles(compressor: Compressor) -> bool:
    """Whether ``compressor`` exchanges ``IndexedSlices`` over their touched rows (``Identity``,
    ``FP16``, ``BF16`` and ``TopK`` themselves, not subclasses)."""
    return type(compressor) in (Identity, FP16, BF16, TopK)


def keeps_rows(
    compressor: Compressor, with_momentum: bool, clipped: bool, measured: bool, per_replica: bool
) -> bool:
    """Whether a one-variable unit keeps an ``IndexedSlices`` gradient as rows (otherwise it
    is densified, see the module docstring)."""
    return handles(compressor) and not (with_momentum or clipped or measured or per_replica)


def combined(slices: tf.IndexedSlices) -> tuple[tf.Tensor, tf.Tensor]:
    """``(rows, values)``: the distinct row indices (int64, ascending) and the sum of the
    values given for each."""
    indices = tf.cast(slices.indices, tf.int64)
    rows, position = tf.unique(indices)
    order = tf.argsort(rows)
    rank = tf.math.invert_permutation(order)  # each distinct row's place in ascending order
    # one pass adding each value into its row's place, in index order (as
    # unsorted_segment_sum, without its slow CPU kernel and the gather of the sums after it)
    shape = tf.concat([tf.shape(rows), tf.shape(slices.values)[1:]], axis=0)
    summed = tf.scatter_nd(tf.gather(rank, position)[:, None], slices.values, shape)
    return tf.gather(rows, order), summed


def start(
    compressor: Compressor,
    slices: tf.IndexedSlices,
    shape: tf.TensorShape,
    before: UnitMemory,
    replicas: Replicas,
) -> Opening:
    """Begin the exchange of one variable's sparse gradient: compress its touched rows with
    their residual, and the protocol that gathers every replica's rows. ``before.residual``
    may be the residual's variable (only the touched rows are read); the kept residual is
    ``IndexedSlices`` of the touched rows (``None`` without error feedback)."""
    shape = tf.TensorShape(shape)
    rows, values = combined(slices)
    old = None
    if before.residual is not None:
        old = replica_values.read_rows(before.residual, rows)
    if isinstance(compressor, TopK):
        acc = values if old is None else values + old
        payload, remainder = _top_entries(compressor, acc, rows, shape)
        rounds = _entries_round(payload, shape, acc.dtype, replicas)
    else:
        sent, remainder = _sent_rows(compressor, values, old)
        payload = (rows, sent)
        rounds = _rows_round(payload, shape, values.dtype, replicas)
    kept = None
    if before.residual is not None:
        kept = tf.IndexedSlices(remainder, rows, _dense_shape(shape))
    return Opening(rounds, shape, payload, UnitMemory(kept))


def wire_bytes(payload: tuple[tf.Tensor, ...]) -> tf.Tensor:
    """The bytes of a sparse payload this step (it depends on the rows touched)."""
    return tf.add_n([tf.size(t, out_type=tf.int64) * t.dtype.size for t in payload])


def _k(compressor: TopK, entries: tf.Tensor) -> tf.Tensor:
    """TopK's ``k`` over ``entries`` touched entries (int64): the fixed ``k`` clamped to
    them, else ``max(1, ceil(ratio * entries))`` exactly in the ratio's decimal value."""
    if compressor.k is not None:
        return tf.minimum(tf.constant(compressor.k, tf.int64), entries)
    ratio = decimal_ratio(compressor.ratio)
    p, q = tf.constant(ratio.numerator, tf.int64), tf.constant(ratio.denominator, tf.int64)
    k = (p * entries + q - 1) // q
    return tf.minimum(entries, tf.maximum(k, tf.minimum(entries, 1)))


def _top_entries(
    compressor: TopK, acc: tf.Tensor, rows: tf.Tensor, shape: tf.TensorShape
) -> tuple[tuple[tf.Tensor, tf.Tensor], tf.Tensor]:
    """``((flat indices in the variable, values in the wire dtype), remainder rows)``: the
    ``k`` largest entries of ``acc`` (the touched rows) and what stays of ``acc``."""
    width = shape[1:].num_elements()
    flat = tf.reshape(acc, [-1])
    k = _k(compressor, tf.size(flat, out_type=tf.int64))
    values, indices, remainder = ops.topk_error_feedback(
        flat, tf.zeros_like(flat), k, index_dtype=tf.int64
    )
    wire = compressor.wire_dtype(values.dtype)
    sent = values if wire == values.dtype else saturating_cast(values, wire)
    if sent.dtype != values.dtype:  # the rounding error stays, by TopK's dense rule
        error = values - tf.cast(sent, values.dtype)
        tiny = tf.constant(np.finfo(values.dtype.as_numpy_dtype).tiny, values.dtype)
        error = tf.where(tf.abs(error) >= tiny, error, tf.zeros_like(error))  # False for NaN
        remainder = tf.tensor_scatter_nd_add(remainder, indices[:, None], error)
    in_variable = tf.gather(rows, indices // width) * width + indices % width
    return (in_variable, sent), tf.reshape(remainder, tf.shape(acc))


def _entries_round(
    payload: tuple[tf.Tensor, tf.Tensor], shape: tf.TensorShape, dtype: tf.DType, replicas: Replicas
) -> Protocol:
    """Every replica's entries gathered; the update is the rows holding any, summed and
    divided by the divisor."""
    indices, values = yield Transfer(GATHER_ROWS, payload)
    width = shape[1:].num_elements()
    rows, position = tf.unique(indices // width)
    at = tf.stack([tf.cast(position, tf.int64), indices % width], axis=1)
    summed = tf.scatter_nd(at, tf.cast(values, dtype), tf.stack([tf.size(rows, tf.int64), width]))
    summed = tf.reshape(summed, [-1, *shape[1:].as_list()])
    update = tf.IndexedSlices(scaled(summed, replicas.divisor), rows, _dense_shape(shape))
    return Outcome(update, shared=(values,))


def _sent_rows(
    compressor: Compressor, values: tf.Tensor, old: tf.Tensor | None
) -> tuple[tf.Tensor, tf.Tensor | None]:
    """``(rows sent, remainder)`` of ``acc = values + old`` (``old``: the touched rows'
    residual, ``None`` without error feedback, and then no remainder), by the codec's own
    dense compression of the rows: ``acc`` itself for ``Identity``, ``acc`` in the wire type
    for a cast (its fused cast-and-feedback op), the remainder ``acc - decompress(sent)``."""
    if old is None:
        payload, _ = compressor.compress(values)
        return payload[0], None
    payload, _, remainder = compressor.compress_with_feedback(values, old)
    return payload[0], remainder


def _rows_round(
    payload: tuple[tf.Tensor, tf.Tensor],
    shape: tf.TensorShape,
    dtype: tf.DType,
    replicas: Replicas,
) -> Protocol:
    """Every replica's rows gathered; the update is their values in ``dtype``, a row several
    replicas sent summed (:func:`combined`, as in the dense gradient), divided by the
    divisor."""
    rows, sent = yield Transfer(GATHER_ROWS, payload)
    values = tf.cast(sent, dtype)
    if replicas.count > 1:
        rows, values = combined(tf.IndexedSlices(values, rows))
    update = tf.IndexedSlices(scaled(values, replicas.divisor), rows, _dense_shape(shape))
    return Outcome(update, shared=(sent,))


def _dense_shape(shape: tf.TensorShape) -> tf.Tensor:
    return tf.constant(shape.as_list(), tf.int64)
