"""TopK units of one bucket sent as one packed payload.

A bucket of many small tensors (a convnet's kernels, batch-norm scales and biases) would cost
a selection, an index code, two transferred tensors, a decode, a scatter and a finite check
per tensor: thousands of small ops a step, which a CPU step pays in dispatch more than in
work. Here the bucket's TopK units with error feedback are compressed together: one
:func:`~tf_sparsify.ops.topk_error_feedback_packed` (each tensor keeps its own k, the same
selection and residuals as one op per tensor), one :func:`~tf_sparsify.ops.encode_indices_packed`,
one gathered ``(values, code)`` pair, one finite check, and one
:func:`~tf_sparsify.ops.packed_decompress_sum` (or, for in-place SGD, one
:func:`~tf_sparsify.ops.decode_indices_packed`, each variable's
:class:`~tf_sparsify.compressors.rounds.SparseUpdate` naming its columns of the gathered
entries, which :func:`~tf_sparsify.ops.sparse_sgd_apply_packed` applies in one op). The wire
bytes are those of the units sent alone (the values and index codes, concatenated); updates
and residuals are the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.compressors.error_memory import UnitMemory
from tf_sparsify.compressors.rounds import (
    GATHER,
    Outcome,
    ReplicaGroup,
    Rounds,
    SparseUpdate,
    Transfer,
)
from tf_sparsify.compressors.topk import TopK


def packs(compressor: TopK, dtype: tf.DType) -> bool:
    """Whether units of ``compressor`` (``packs_in_buckets``) with error feedback can travel
    packed: values sent in the tensor's dtype, on a machine without GPUs (the packed ops run on
    the CPU; on a GPU each tensor keeps the GPU kernel)."""
    return (
        compressor.packs_in_buckets
        and compressor.wire_dtype(dtype) == dtype
        and not tf.config.list_logical_devices("GPU")
    )


def start(
    units: Sequence,
    grads: Sequence[tf.Tensor],
    residuals: Sequence[tf.Tensor],
    replicas: ReplicaGroup,
    sparse_updates: bool,
) -> tuple[tuple[tf.Tensor, tf.Tensor], Rounds, UnitMemory]:
    """Compress the one-variable TopK ``units`` (with their ``grads`` and ``residuals``)
    together: the packed payload, the protocol that gathers and decompresses it (its update is
    a list, one entry per unit), and what is kept (the residuals, a list)."""
    shapes = [u.shapes[0] for u in units]
    sizes = [
        (s.num_elements(), u.compressor.num_selected(s.num_elements()))
        for u, s in zip(units, shapes, strict=True)
    ]
    values, indices, new_residuals = ops.topk_error_feedback_packed(
        list(grads), list(residuals), [k for _, k in sizes]
    )
    payload = (values, ops.encode_indices_packed(indices, sizes))
    rounds = _rounds(payload, shapes, sizes, replicas, sparse_updates)
    return payload, rounds, UnitMemory(new_residuals)


def _rounds(
    payload: tuple[tf.Tensor, tf.Tensor],
    shapes: list[tf.TensorShape],
    sizes: list[tuple[int, int]],
    replicas: ReplicaGroup,
    sparse_updates: bool,
) -> Rounds:
    """One gather of the packed payload, then every unit's update at once."""
    values, code = yield Transfer(GATHER, payload)
    ks = [k for _, k in sizes]
    if sparse_updates:
        indices = ops.decode_indices_packed(code, sizes)
        scale = 1.0 / replicas.divisor
        starts = np.cumsum([0, *ks[:-1]]).tolist()
        update = [
            SparseUpdate(values, indices, scale, (start, k))
            for start, k in zip(starts, ks, strict=True)
        ]
    else:
        update = ops.packed_decompress_sum(values, code, shapes, ks, 1.0 / replicas.divisor)
    return Outcome(update, shared=(values,))
