"""The sparse-rows path reads only the touched rows of a residual
(:mod:`tf_sparsify.core.routes.sparse_rows`):
once a step has written rows into it, TF copies a variable's whole value on every dense read
(its copy-on-read mode after a scatter), 64 MB a step for a 32k x 512 embedding."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tf_sparsify as tfs


def test_a_sparse_step_gathers_and_scatters_the_residual_rows_without_a_dense_read():
    variable = keras.Variable(np.zeros((40, 6), np.float32), name="embedding")
    optimizer = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.25))
    optimizer.build([variable])
    rows = tf.constant([3, 7, 3, 12])
    values = tf.reshape(tf.range(24, dtype=tf.float32), (4, 6))

    @tf.function
    def step():
        optimizer.apply_gradients([(tf.IndexedSlices(values, rows, (40, 6)), variable)])

    graph = step.get_concrete_function().graph
    handle = optimizer.residuals[0].value.handle
    inside = {internal.name for external, internal in graph.captures if external is handle}
    readers = {op.type for op in graph.get_operations() if any(t.name in inside for t in op.inputs)}
    # the touched rows gathered; the cond writing them back takes the handle, not a value
    assert readers == {"ResourceGather", "If"}
    step()
    step()
    touched = np.isin(np.arange(40), [3, 7, 12])
    kept = optimizer.residuals[0].numpy()
    assert kept[touched].any() and not kept[~touched].any()  # untouched rows wait unchanged
