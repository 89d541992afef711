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
:func:`tf_sparsify.core.replica_values.write_rows`): a row's residual is what was not sent of it,
and the residual of a row the step does not touch waits unchanged (it is not a candidate for
TopK's selection) until the row is touched again. Nothing decays and nothing is lost, so
conservation holds exactly as on the dense path: the sum of the applied updates plus every
replica's residual equals the sum of the gradients. A step that is not finite on every replica
writes no rows (:func:`tf_sparsify.compressors.error_memory.store_if_finite`).

Duplicates are combined, on each replica and across replicas, before the inner optimizer sees
them, so it gets rows of the dense gradient (of the update, for a lossy compressor) and an
update that is not linear in the gradient gets what the dense gradient would give it: Keras'
Adam and Adagrad given raw ``IndexedSlices`` square each duplicate index apart (Keras' Adam
decays the moments of every row either way), so on an embedding plain Keras differs from
Keras on the densified gradient, and the wrapper equals the latter on every path.

Under XLA (``jit_compile=True``), where shapes cannot depend on the data, the same rows travel
padded to a bound the batch gives: a step touches at most ``min(len(indices), rows of the
variable)`` rows. The distinct rows come first, ascending, their count a tensor (:func:`padded`:
a stable sort and one ordered scatter, adding duplicates in the order :func:`combined` does);
padding rows repeat the first row with zero values, add nothing to it and write back what it
writes. TopK's ``k`` is the same (from the touched entries): the selection op takes the ``k``
it would keep of the padded rows, a static count at least ``k``, and the first ``k`` of them by
magnitude (ties to the lowest index) are the entries selected without XLA, since a padding
zero follows every touched entry; the others stay in the residual. Payloads of one size travel
by a plain all-gather, empty slots and padding rows marked by the index -1 (``bytes_sent``
counts them: they travel); the update's padding rows repeat its first row, with zeros. Weights
and residuals are those without XLA, bit for bit where XLA rounds the rest of the step alike.

Everything else densifies the gradient first (:class:`SparseRowsRoute` does not claim it), losing no
gradient mass (the dense path's error feedback keeps the residual): other compressors (QSGD,
TernGrad and ScaledSign sum payloads of one dense layout by all-reduce; RandomK's shared
indices and PowerSGD's factors span the whole tensor; the sparse all-reduce splits the whole
index range; a subclass of Identity, the casts or TopK may change what they send), momentum
correction (the buffer decays every row each step), local clipping, diagnostics, per-replica
contributions (delayed updates, IAG), simulated workers, units of several variables
(``scope="global"``) and collectives without an all-gather of varying row counts (the
hierarchical Horovod exchange).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.compressors.base import Compressor
from tf_sparsify.compressors.dense import saturating_cast
from tf_sparsify.compressors.error_memory import UnitMemory
from tf_sparsify.compressors.rounds import (
    GATHER,
    GATHER_ROWS,
    Outcome,
    ReplicaGroup,
    Rounds,
    Started,
    Transfer,
    scaled,
)
from tf_sparsify.compressors.topk import TopK, rounding_error
from tf_sparsify.core import replica_values
from tf_sparsify.core.plan import Unit
from tf_sparsify.core.routes.route import Message, Route, StepContext
from tf_sparsify.ops.pure_tf import magnitude_key
from tf_sparsify.ops.xla import in_xla_context


class SparseRowsRoute(Route):
    """Claims a one-variable unit whose gradient is ``IndexedSlices`` and whose compressor
    ``travels_as_rows`` (``Identity``, ``FP16``, ``BF16``, ``TopK``), when the collective
    gathers rows of varying counts and no option needs the whole dense gradient (momentum
    correction, local clipping, diagnostics, per-replica contributions): see the module
    docstring."""

    def claims(self, unit: Unit, step: StepContext) -> bool:
        return (
            unit.compressor.travels_as_rows
            and len(unit.indices) == 1
            and isinstance(step.grads[unit.indices[0]], tf.IndexedSlices)
            and step.gathers_rows
            and not (step.momentum_factor or step.clipped)
            and not (step.flags.measured or step.flags.per_replica)
        )

    def start(self, claimed: list[tuple[int, Unit]], step: StepContext) -> list[Message]:
        messages = []
        for _, unit in claimed:
            i = unit.indices[0]
            residual = step.memory.residuals[i] if unit.error_feedback else None
            before = UnitMemory(residual)  # the variable: only the touched rows are read
            started = start(unit.compressor, step.grads[i], unit.shape, before, step.replicas)
            messages.append(
                Message(unit, self, started.rounds, before, started.after, started.payload)
            )
        return messages

    def finish(self, message: Message, outcome: Outcome) -> None:
        message.updates = [outcome.update]
        message.residuals = [message.after.residual]
        message.momenta = [None]

    def sent_bytes(self, message: Message) -> tf.Tensor:
        """The bytes of the payload this step (they depend on the rows touched)."""
        return tf.add_n([tf.size(t, out_type=tf.int64) * t.dtype.size for t in message.payload])


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
    replicas: ReplicaGroup,
) -> Started:
    """Begin the exchange of one variable's sparse gradient: compress its touched rows with
    their residual, and the protocol that gathers every replica's rows. ``before.residual``
    may be the residual's variable (only the touched rows are read); the kept residual is
    ``IndexedSlices`` of the touched rows (``None`` without error feedback). Under XLA the
    rows are padded to a bound the batch gives (:func:`padded`)."""
    shape = tf.TensorShape(shape)
    count = None  # under XLA, how many rows are touched (the rows after them are padding)
    if in_xla_context():
        rows, values, count = padded(slices, shape[0])
    else:
        rows, values = combined(slices)
    old = None
    if before.residual is not None:  # a padding row repeats the first: it adds nothing
        old = _touched(replica_values.read_rows(before.residual, rows), count, 0)
    if compressor.sends_entries:  # TopK: the k largest entries
        acc = values if old is None else values + old
        payload, remainder = _top_entries(compressor, acc, rows, shape, count)
        rounds = _entries_round(payload, shape, acc.dtype, replicas, count is not None)
    else:
        sent, remainder = _sent_rows(compressor, values, old)
        payload = (_touched(rows, count, -1), sent)
        rounds = _rows_round(payload, shape, values.dtype, replicas, count is not None)
    kept = None
    if before.residual is not None:  # a padding row writes what the first row writes
        kept = tf.IndexedSlices(
            _touched(remainder, count, remainder[:1]), rows, _dense_shape(shape)
        )
    return Started(rounds, shape, payload, UnitMemory(kept))


def padded(slices: tf.IndexedSlices, vocabulary: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """:func:`combined` in shapes XLA can compile: ``(rows, values, count)``, the ``count``
    distinct rows (ascending) and their sums first, then padding up to the bound
    ``min(len(indices), vocabulary)``: rows that repeat the first row, values zero."""
    indices = tf.cast(slices.indices, tf.int64)
    bound = tf.minimum(tf.size(indices, out_type=tf.int64), vocabulary)
    slot, rows, count = _distinct(indices, tf.ones_like(indices, tf.bool), bound)
    return rows, _summed(slot[:, None], slices.values, bound), count


def _top_entries(
    compressor: TopK,
    acc: tf.Tensor,
    rows: tf.Tensor,
    shape: tf.TensorShape,
    count: tf.Tensor | None = None,
) -> tuple[tuple[tf.Tensor, tf.Tensor], tf.Tensor]:
    """``((flat indices in the variable, values in the wire dtype), remainder rows)``: the
    ``k`` largest entries of ``acc`` (the touched rows) and what stays of ``acc``. With
    ``count`` (under XLA), ``acc``'s rows after the first ``count`` are padding (zeros):
    ``k`` is the same, from the ``count`` touched rows, and the payload has a slot for every
    entry :func:`_top_of_padded` may select, those left empty marked by the index -1."""
    width = shape[1:].num_elements()
    flat = tf.reshape(acc, [-1])
    if count is None:
        k = compressor.num_selected(tf.size(flat, out_type=tf.int64))
        values, indices, remainder = ops.topk_error_feedback(
            flat, tf.zeros_like(flat), k, index_dtype=tf.int64
        )
        chosen = None
    else:
        values, indices, remainder, chosen = _top_of_padded(compressor, flat, count * width)
    wire = compressor.wire_dtype(values.dtype)
    sent = values if wire == values.dtype else saturating_cast(values, wire)
    left = None  # what stays at the selected entries: the rounding error, by TopK's dense rule
    if sent.dtype != values.dtype:
        left = rounding_error(values, sent)
    in_variable = tf.gather(rows, indices // width) * width + indices % width
    if chosen is not None:  # the entries not chosen stay, and travel as empty slots
        left = tf.where(chosen, tf.zeros_like(values) if left is None else left, values)
        sent = tf.where(chosen, sent, tf.zeros_like(sent))
        in_variable = tf.where(chosen, in_variable, tf.constant(-1, tf.int64))
    if left is not None:
        remainder = tf.tensor_scatter_nd_update(remainder, indices[:, None], left)
    return (in_variable, sent), tf.reshape(remainder, tf.shape(acc))


def _top_of_padded(
    compressor: TopK, flat: tf.Tensor, entries: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """``(values, indices, remainder, chosen)``: TopK's selection over the first ``entries``
    of ``flat`` (the touched rows; zeros follow them) in shapes XLA can compile. The fused op
    selects ``num_selected`` of all of ``flat``, at least the ``k`` TopK keeps of ``entries``;
    ranked by magnitude, ties to the lowest index as the op ranks them, the first ``k`` of those are
    the ``k`` the op would select from the touched entries alone (a trailing zero never ranks
    before a touched entry), ``chosen`` marks them. ``remainder`` has every selected entry
    zeroed, chosen or not."""
    capacity = compressor.num_selected(tf.size(flat, out_type=tf.int64))
    values, indices, remainder = ops.topk_error_feedback(
        flat, tf.zeros_like(flat), capacity, index_dtype=tf.int64
    )
    by_rank = tf.argsort(magnitude_key(values), direction="DESCENDING", stable=True)
    chosen = _inverse(by_rank) < compressor.num_selected(entries)
    return values, indices, remainder, chosen


def _entries_round(
    payload: tuple[tf.Tensor, tf.Tensor],
    shape: tf.TensorShape,
    dtype: tf.DType,
    replicas: ReplicaGroup,
    padded: bool = False,
) -> Rounds:
    """Every replica's entries gathered; the update is the rows holding any, summed and
    divided by the divisor. ``padded`` (XLA): payloads of one size travel by an all-gather,
    empty slots marked by the index -1; the update's rows are padded as :func:`padded`'s."""
    indices, values = yield from _gathered(payload, padded)
    width = shape[1:].num_elements()
    if padded:
        valid = indices >= 0
        bound = tf.minimum(tf.size(indices, out_type=tf.int64), shape[0])
        position, rows, _ = _distinct(indices // width, valid, bound)
        at = tf.stack([position, tf.where(valid, indices % width, 0)], axis=1)
        summed = _summed(at, tf.cast(values, dtype), bound, [width])
    else:
        rows, position = tf.unique(indices // width)
        at = tf.stack([tf.cast(position, tf.int64), indices % width], axis=1)
        size = tf.stack([tf.size(rows, tf.int64), width])
        summed = tf.scatter_nd(at, tf.cast(values, dtype), size)
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
    replicas: ReplicaGroup,
    padded: bool = False,
) -> Rounds:
    """Every replica's rows gathered; the update is their values in ``dtype``, a row several
    replicas sent summed (:func:`combined`, as in the dense gradient), divided by the
    divisor. ``padded`` (XLA): as in :func:`_entries_round`, padding rows marked by -1."""
    rows, sent = yield from _gathered(payload, padded)
    values = tf.cast(sent, dtype)
    if padded and replicas.count > 1:
        valid = rows >= 0
        bound = tf.minimum(tf.size(rows, out_type=tf.int64), shape[0])
        position, rows, _ = _distinct(rows, valid, bound)
        values = _summed(position[:, None], values, bound)
    elif padded:
        rows = tf.where(rows >= 0, rows, rows[:1])
    elif replicas.count > 1:
        rows, values = combined(tf.IndexedSlices(values, rows))
    update = tf.IndexedSlices(scaled(values, replicas.divisor), rows, _dense_shape(shape))
    return Outcome(update, shared=(sent,))


def _gathered(payload: tuple[tf.Tensor, ...], padded: bool) -> Rounds:
    """Every replica's ``payload`` tensors, concatenated in replica order: by an all-gather
    of varying row counts, or with ``padded`` (XLA, one size everywhere) a plain one."""
    if not padded:
        return (yield Transfer(GATHER_ROWS, payload))
    stacked = yield Transfer(GATHER, payload)
    return tuple(tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0)) for t in stacked)


def _distinct(
    keys: tf.Tensor, valid: tf.Tensor, bound: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """For XLA, in shapes that do not depend on the data: ``(slot, distinct, count)``, the
    ``count`` distinct valid ``keys`` ascending in ``bound`` slots (at most ``bound`` of them;
    the slots after them repeat the first), and each key's slot (``bound`` if not valid)."""
    last = tf.constant(keys.dtype.max, keys.dtype)
    order = tf.argsort(tf.where(valid, keys, last), stable=True)
    ordered, kept = tf.gather(keys, order), tf.gather(valid, order)
    new = tf.logical_and(kept, tf.concat([[True], ordered[1:] != ordered[:-1]], 0))
    ordered_slot = tf.where(kept, tf.cumsum(tf.cast(new, tf.int64)) - 1, bound)
    slot = tf.gather(ordered_slot, _inverse(order))
    firsts = tf.where(new, ordered_slot, bound)
    distinct = tf.scatter_nd(firsts[:, None], ordered, [bound + 1])[:bound]
    count = tf.reduce_sum(tf.cast(new, tf.int64))
    return slot, _touched(distinct, count, distinct[:1]), count


def _summed(
    at: tf.Tensor, values: tf.Tensor, bound: tf.Tensor, inner: list[int] | None = None
) -> tf.Tensor:
    """``values`` added at ``at`` (slots, as :func:`_distinct` gives them, with the entries'
    positions in their rows when ``inner`` is the row shape) in input order, as
    :func:`combined` adds them; the spare slot ``bound`` dropped."""
    inner = tf.shape(values)[1:] if inner is None else inner
    shape = tf.concat([[bound + 1], tf.cast(inner, tf.int64)], 0)
    return tf.scatter_nd(at, values, shape)[:bound]


def _inverse(permutation: tf.Tensor) -> tf.Tensor:
    """The inverse of ``permutation`` (int64; XLA does not compile ``invert_permutation``
    here)."""
    permutation = tf.cast(permutation, tf.int64)
    size = tf.size(permutation, out_type=tf.int64)
    return tf.scatter_nd(permutation[:, None], tf.range(size), size[None])


def _touched(tensor: tf.Tensor, count: tf.Tensor | None, padding: Any) -> tf.Tensor:
    """``tensor`` with its rows after the first ``count`` (padding under XLA) replaced by
    ``padding`` (broadcast to them); as it is when ``count`` is ``None``."""
    if count is None:
        return tensor
    among = tf.range(tf.shape(tensor, out_type=tf.int64)[0]) < count
    among = tf.reshape(among, [-1] + [1] * (tensor.shape.rank - 1))
    return tf.where(among, tensor, tf.cast(padding, tensor.dtype))


def _dense_shape(shape: tf.TensorShape) -> tf.Tensor:
    return tf.constant(shape.as_list(), tf.int64)
