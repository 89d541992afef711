"""Split-and-reduce sparse all-reduce of TopK entries (after Ok-Topk, Li and Hoefler 2022, and
SparCML, Renggli et al. 2019): the bytes each replica sends and receives stay flat in the
number of replicas, where an all-gather of TopK payloads grows with it."""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.common.checks import check_int
from tf_sparsify.common.dtypes import dtype_bytes
from tf_sparsify.compressors.base import (
    Context,
    MultiRoundMethod,
    check_ratio,
    k_for,
)
from tf_sparsify.compressors.rounds import (
    ALL_TO_ALL,
    GATHER_ROWS,
    Outcome,
    ReplicaGroup,
    Rounds,
    Transfer,
    scaled,
)
from tf_sparsify.ops.pure_tf import index_dtype


class SparseAllReduce(MultiRoundMethod):
    """TopK whose entries are summed by their owners instead of gathered by everyone.

    Give exactly one of ``ratio`` (k = max(1, ceil(ratio * n)), exact in the ratio's decimal
    value, as TopK's) or ``k`` (clamped to the tensor's size). The flat index space ``[0, n)``
    is split into ``P`` contiguous slices, ``[floor(q n / P), floor((q + 1) n / P))`` owned by
    replica ``q``. Per step and replica:

    1. select the top k of ``acc = x + e`` (the fused TopK op: ties to the lowest index, NaN
       and Inf first); ``e = acc - selected``;
    2. all-to-all: each selected entry (value, index) goes to the owner of its index;
    3. the owner sums what it received (duplicates add) over its slice; the indices it
       received are its support, ``u`` of them. It keeps the top ``m = min(u, ceil(k / P))``
       entries of the sum on its support (all of them when ``u <= ceil(k / P)``) and adds
       the rest of the sum to its own residual at those indices;
    4. all-gather of varying sizes: every owner's kept entries (values, then indices), so
       every replica scatters the same sum, divided by the divisor, as its update.
    5. dense fallback (SparCML): an owner whose ``m`` kept entries would take at least the
       bytes of its whole slice sent dense, ``m (v + i) >= s v + i`` (``s`` the slice length,
       ``v``/``i`` the value/index bytes), sends the slice's sum dense instead (nothing
       dropped), and one index ``-1 - q`` in place of its indices; receivers expand that
       marker to the slice ``q``'s indices. So an owner sends at most ``ceil(k / P)``
       entries' bytes, and a replica about ``k + k / P`` entries in all; each replica
       receives about ``2 k`` (the all-to-all sends ``k (P - 1) / P`` of its entries to
       other replicas, the all-gather brings ``k (P - 1) / P`` from them): flat in ``P``.

    Conservation: with ``a_p = x_p + e_p``, step 1 splits ``a_p`` into sent and kept; the
    owners' sums add up every sent entry, and step 3 splits each sum into applied and
    dropped, the dropped part going into its owner's residual. So ``sum_p e_p' + divisor *
    update = sum_p a_p`` each step (up to the rounding of the sums), and over steps ``sum_p
    e_p + applied updates * divisor = sum of all gradients``. A residual then holds, in its
    own slice, what others sent that its replica did not re-select; it enters the next
    step's sum once, like any residual. On a single replica the algorithm is TopK with error
    feedback (the owner keeps all its ``k`` entries).

    Error feedback is on by default and part of the algorithm (as in Ok-Topk), without a
    per-replica contraction: a residual can hold others' entries. A non-finite entry of any
    replica's ``acc`` is selected, reaches its owner's sum, is re-selected (NaN and Inf rank
    highest) and so reaches the all-gathered values every replica checks.

    Needs a collective with an all-to-all and an all-gather of varying sizes: Horovod
    (``tf_sparsify.horovod``) or a single replica; tf.distribute's collectives have neither.
    ``wire_bytes`` counts the first round, ``k (v + i)``; the second round (at most
    ``ceil(k / P) (v + i)``, fewer when an owner's support is smaller) depends on ``P`` and
    the data, and Horovod's byte counter (``bytes_to_horovod``) counts both.
    """

    unbiased = False
    summable = False
    error_feedback_by_design = True
    #: NaN and Inf rank highest in both selections: they reach the all-gathered values
    reveals_non_finite = True
    #: how many entries each owner receives and keeps depends on the data
    runs_under_xla = False

    def __init__(self, ratio: float | None = None, k: int | None = None):
        if (ratio is None) == (k is None):
            raise ValueError(
                "SparseAllReduce needs exactly one of `ratio` or `k`; "
                f"received ratio={ratio!r}, k={k!r}"
            )
        self.ratio = None if ratio is None else check_ratio(ratio)
        self.k = None if k is None else check_int("k", k)

    def num_selected(self, num_elements: int) -> int:
        """Entries each replica selects and sends in the all-to-all."""
        return k_for(num_elements, self.ratio, self.k)

    def num_kept(self, num_elements: int, num_replicas: int) -> int:
        """Entries an owner keeps of its slice's sum at most: ``ceil(k / P)``."""
        return math.ceil(self.num_selected(num_elements) / num_replicas)

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        """The all-to-all's ``k (v + i)`` bytes (see the class docstring for the second
        round)."""
        return self.num_selected(num_elements) * _entry_bytes(num_elements, dtype)

    def rounds(
        self,
        tensor: tf.Tensor,
        residual: tf.Tensor | None,
        state: tuple[tf.Tensor, ...],
        ctx: Context,
        replicas: ReplicaGroup,
    ) -> Rounds:
        n = ctx.num_elements
        flat = tf.reshape(tensor, [-1])
        kept = tf.zeros_like(flat) if residual is None else tf.reshape(residual, [-1])
        values, indices, remainder = ops.topk_error_feedback(flat, kept, self.num_selected(n))
        slices = Slices(n, replicas.count, index_dtype(n))
        received = yield Transfer(ALL_TO_ALL, (values, indices), slices.splits(indices))
        owner = tf.cast(replicas.replica_id, slices.dtype)
        k_kept = self.num_kept(n, replicas.count)
        sent_values, sent_indices, dropped = reduce_slice(*received, slices, owner, k_kept)
        gathered_values, gathered_indices = yield Transfer(GATHER_ROWS, (sent_values, sent_indices))
        total = ops.scatter_sum(gathered_values, slices.expand(gathered_indices), n)
        new_residual = None
        if residual is not None:
            new_residual = tf.reshape(remainder + slices.embed(dropped, owner), ctx.shape)
        update = scaled(tf.reshape(total, ctx.shape), replicas.divisor)
        return Outcome(update, new_residual, shared=(gathered_values,))

    def get_config(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "k": self.k}


class Slices:
    """The split of ``[0, n)`` into ``count`` contiguous slices, slice ``q`` being
    ``[floor(q n / count), floor((q + 1) n / count))``, and the index arithmetic on it."""

    def __init__(self, n: int, count: int, dtype: tf.DType):
        self.n, self.count, self.dtype = n, count, dtype
        self.bounds = tf.constant([q * n // count for q in range(count + 1)], dtype)

    def start(self, owner: tf.Tensor) -> tf.Tensor:
        return tf.gather(self.bounds, owner)

    def size(self, owner: tf.Tensor) -> tf.Tensor:
        return tf.gather(self.bounds, owner + 1) - tf.gather(self.bounds, owner)

    def splits(self, indices: tf.Tensor) -> tf.Tensor:
        """How many of the ascending ``indices`` fall in each slice (int32, per replica)."""
        ends = tf.searchsorted(indices, self.bounds[1:], side="left")
        return tf.cast(ends - tf.concat([[0], ends[:-1]], axis=0), tf.int32)

    def expand(self, indices: tf.Tensor) -> tf.Tensor:
        """Gathered indices with each dense marker ``-1 - q`` replaced by slice ``q``'s
        indices, in order (so they line up with the gathered values)."""
        marker = indices < 0
        owner = tf.where(marker, -1 - indices, tf.zeros_like(indices))
        lengths = tf.where(marker, self.size(owner), tf.ones_like(indices))
        starts = tf.where(marker, self.start(owner), indices)
        offsets = tf.cumsum(lengths, exclusive=True)
        within = tf.range(tf.reduce_sum(lengths), dtype=self.dtype) - tf.repeat(offsets, lengths)
        return tf.repeat(starts, lengths) + within

    def embed(self, part: tf.Tensor, owner: tf.Tensor) -> tf.Tensor:
        """``[n]``: ``part`` at slice ``owner``'s indices, zeros elsewhere."""
        start = self.start(owner)
        padding = tf.stack([start, self.n - start - self.size(owner)])[None]
        return tf.reshape(tf.pad(part, padding), [self.n])


def reduce_slice(
    values: tf.Tensor, indices: tf.Tensor, slices: Slices, owner: tf.Tensor, k_kept: int
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The owner's step: ``(values, indices, dropped)`` to send for the entries it received
    (global ``indices``) and what it drops, over its slice."""
    start, size = slices.start(owner), slices.size(owner)
    local = indices - start
    total = ops.scatter_sum(values, local, size)
    hits = ops.scatter_sum(tf.ones_like(values), local, size)
    support = tf.cast(tf.where(hits > 0)[:, 0], slices.dtype)
    m = tf.minimum(tf.size(support, out_type=slices.dtype), k_kept)
    entry = _entry_bytes(slices.n, values.dtype)
    value_bytes = tf.cast(values.dtype.size, slices.dtype)
    dense = size * value_bytes + slices.dtype.size <= m * entry

    def whole_slice():
        marker = tf.reshape(-1 - owner, [1])
        return total, marker, tf.zeros_like(total)

    def top_of_support():
        on_support = tf.gather(total, support)
        kept, at, rest = ops.topk_error_feedback(on_support, tf.zeros_like(on_support), m)
        chosen = start + tf.gather(support, tf.cast(at, slices.dtype))
        return kept, chosen, ops.scatter_sum(rest, support, size)

    return tf.cond(dense, whole_slice, top_of_support)


def _entry_bytes(num_elements: int, dtype: tf.DType) -> int:
    """Bytes of one (value, index) entry."""
    return dtype_bytes(dtype) + index_dtype(num_elements).size
