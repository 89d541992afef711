"""SparseSgdApply and the in-place SGD path: TopK updates applied from the gathered entries,
without building the dense update (kernel = pure-TF reference = NumPy model, the dense path
bit for bit, reads keep their values, bad input, when the path is taken)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify import ops
from tf_sparsify.keras import sparse_sgd
from tf_sparsify.ops import pure_tf as reference

SHAPE = (6, 7)
N = 42


def entries(rows: int, k: int, seed: int, disjoint: bool = False) -> np.ndarray:
    """``[rows, k]`` strictly ascending flat indices below N (rows overlap unless disjoint)."""
    rng = np.random.default_rng(seed)
    if disjoint:
        picked = rng.permutation(N)[: rows * k].reshape(rows, k)
        return np.sort(picked, axis=1)
    return np.stack([np.sort(rng.choice(N, k, replace=False)) for _ in range(rows)])


def numpy_sgd(var: np.ndarray, values, indices, scale: float, lr: float) -> np.ndarray:
    """Row after row, ``flat[i] -= (value * scale) * lr`` in the variable's dtype."""
    flat = var.reshape(-1).copy()
    cast = var.dtype.type
    for row_values, row_indices in zip(values, indices, strict=True):
        for v, i in zip(row_values, row_indices, strict=True):
            flat[i] = flat[i] - (cast(v) * cast(scale)) * cast(lr)
    return flat.reshape(var.shape)


def case(dtype, rows: int, seed: int = 0, disjoint: bool = False):
    rng = np.random.default_rng(seed + 1)
    init = rng.normal(size=SHAPE).astype(dtype)
    values = rng.normal(size=(rows, 9)).astype(dtype)
    return init, values, entries(rows, 9, seed, disjoint)


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_kernel_equals_reference_and_numpy(compiled, dtype, rows, index_dtype):
    init, values, indices = case(dtype, rows, seed=rows)
    indices = indices.astype(index_dtype)
    want = numpy_sgd(init, values, indices, 0.5, 0.1)
    kernel, ref = tf.Variable(init), tf.Variable(init)
    ops.sparse_sgd_apply(kernel, values, indices, 0.5, 0.1)
    reference.sparse_sgd_apply(
        ref,
        tf.constant(values),
        tf.constant(indices),
        tf.constant(0.5, dtype),
        tf.constant(0.1, dtype),
    )
    np.testing.assert_array_equal(kernel.numpy(), want)
    np.testing.assert_array_equal(ref.numpy(), want)
    assert not np.array_equal(want, init)


def test_bfloat16_kernel_equals_reference(compiled):
    init, values, indices = case("float32", 2)
    kernel = tf.Variable(tf.cast(init, tf.bfloat16))
    ref = tf.Variable(tf.cast(init, tf.bfloat16))
    values = tf.cast(values, tf.bfloat16)
    ops.sparse_sgd_apply(kernel, values, indices, 0.5, 0.1)
    scale, lr = tf.constant(0.5, tf.bfloat16), tf.constant(0.1, tf.bfloat16)
    reference.sparse_sgd_apply(ref, values, tf.constant(indices), scale, lr)
    np.testing.assert_array_equal(kernel.numpy(), ref.numpy())


@pytest.mark.parametrize("rows, disjoint", [(1, False), (3, True)])
def test_equals_the_dense_update_bit_for_bit(compiled, rows, disjoint):
    """One row, or rows sharing no index: exactly ``var -= (ScatterSum * scale) * lr``."""
    init, values, indices = case("float32", rows, seed=5, disjoint=disjoint)
    sparse, dense = tf.Variable(init), tf.Variable(init)
    scale, lr = tf.constant(1 / 3, tf.float32), tf.constant(0.1, tf.float32)
    ops.sparse_sgd_apply(sparse, values, indices, scale, lr)
    total = ops.scatter_sum(values.reshape(-1), indices.reshape(-1), N)
    dense.assign_sub(tf.reshape(total * scale, SHAPE) * lr)
    np.testing.assert_array_equal(sparse.numpy(), dense.numpy())


def test_a_read_before_the_update_keeps_its_value(compiled):
    """Like AssignSubVariableOp: a read still held is not changed under it."""
    init, values, indices = case("float32", 2)
    var = tf.Variable(init)

    @tf.function
    def read_then_update():
        before = var.read_value()
        with tf.control_dependencies([before]):
            ops.sparse_sgd_apply(var, values, indices, 1.0, 1.0)
        return before

    np.testing.assert_array_equal(read_then_update().numpy(), init)
    np.testing.assert_array_equal(var.numpy(), numpy_sgd(init, values, indices, 1.0, 1.0))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda v, i: (v, np.where(i == i[1, 2], 42, i)), r"indices\[1, 2\] = 42 is out of range"),
        (
            lambda v, i: (v, i[:, ::-1]),
            r"SparseSgdApply: each row of indices must be strictly ascending, got "
            r"indices\[0, 1\] = \d+ after \d+",
        ),
        (lambda v, i: (v.astype("float64"), i), "values must have the variable's dtype float32"),
        (lambda v, i: (v, i.astype("float32")), "indices must be int32 or int64"),
        (lambda v, i: (v[:, :4], i), r"values and indices must be \[rows, k\] of one shape"),
    ],
)
def test_bad_input_fails_naming_it_and_leaves_the_variable(compiled, change, message):
    init, values, indices = case("float32", 2)
    var = tf.Variable(init)
    values, indices = change(values, indices)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        ops.sparse_sgd_apply(var, values, indices, 1.0, 1.0)
    np.testing.assert_array_equal(var.numpy(), init)


def test_a_tensor_is_not_a_variable(compiled):
    init, values, indices = case("float32", 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be a resource variable"):
        ops.sparse_sgd_apply(tf.constant(init), values, indices, 1.0, 1.0)


PACKED_SHAPES = [(6, 7), (5,), (3, 3), (4,)]
PACKED_KS = [9, 2, 0, 4]  # a variable with no entries among them


def packed_case(dtype: str, rows: int, seed: int = 0):
    """Initial values, then ``[rows, sum(ks)]`` values and per-variable ascending indices."""
    rng = np.random.default_rng(seed)
    inits = [rng.normal(size=s).astype(dtype) for s in PACKED_SHAPES]
    indices = np.concatenate(
        [
            np.stack([np.sort(rng.choice(int(np.prod(s)), k, replace=False)) for _ in range(rows)])
            for s, k in zip(PACKED_SHAPES, PACKED_KS, strict=True)
        ],
        axis=1,
    )
    values = rng.normal(size=indices.shape).astype(dtype)
    return inits, values, indices


@pytest.mark.parametrize("kernels", [True, False], ids=["compiled", "reference"])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_packed_apply_equals_one_apply_per_variable(
    compiled, monkeypatch, kernels, dtype, rows, index_dtype
):
    """Each variable gets exactly what sparse_sgd_apply on its columns gives (the NumPy model)."""
    if not kernels:
        monkeypatch.setattr(ops, "_compiled", lambda: None)
    inits, values, indices = packed_case(dtype, rows, seed=rows)
    indices = indices.astype(index_dtype)
    variables = [tf.Variable(init) for init in inits]
    ops.sparse_sgd_apply_packed(variables, values, indices, PACKED_KS, 0.5, 0.1)
    start = 0
    for variable, init, k in zip(variables, inits, PACKED_KS, strict=True):
        part = slice(start, start + k)
        want = numpy_sgd(init, values[:, part], indices[:, part], 0.5, 0.1)
        np.testing.assert_array_equal(variable.numpy(), want)
        start += k


BAD = tf.errors.InvalidArgumentError


def replaced(indices: np.ndarray, at: tuple[int, int], value: int) -> np.ndarray:
    out = indices.copy()
    out[at] = value
    return out


@pytest.mark.parametrize(
    "change, error, message",
    [
        (
            lambda v, i, ks: (v, replaced(i, (0, 9), 5), ks),
            BAD,
            r"indices of vars\[1\]\[0, 0\] = 5 is out of range \[0, 5\)",
        ),
        (
            lambda v, i, ks: (v, np.concatenate([i[:, :11], i[:, 11:][:, ::-1]], 1), ks),
            BAD,
            r"SparseSgdApplyPacked: each row of indices of vars\[3\] must be strictly "
            r"ascending, got indices of vars\[3\]\[0, 1\] = \d+ after \d+",
        ),
        (lambda v, i, ks: (v, i, ks[:3]), BAD, r"ks must be 4 counts >= 0"),
        (lambda v, i, ks: (v, i, [9, 2, -1, 5]), BAD, r"ks must be 4 counts >= 0"),
        (lambda v, i, ks: (v, i, [9, 2, 1, 4]), BAD, r"sum\(ks\) = 16 columns"),
    ],
)
def test_packed_apply_checks_every_variable_before_any_changes(compiled, change, error, message):
    inits, values, indices = packed_case("float32", 2)
    variables = [tf.Variable(init) for init in inits]
    values, indices, ks = change(values, indices, PACKED_KS)
    with pytest.raises(error, match=message):
        ops.sparse_sgd_apply_packed(variables, values, indices, ks, 1.0, 1.0)
    for variable, init in zip(variables, inits, strict=True):
        np.testing.assert_array_equal(variable.numpy(), init)


def test_packed_apply_needs_variables_of_one_dtype(compiled):
    inits, values, indices = packed_case("float32", 1)
    variables = [tf.Variable(init) for init in inits]
    variables[2] = tf.Variable(inits[2].astype("float64"))
    with pytest.raises(BAD, match=r"variables must share one dtype"):
        ops.sparse_sgd_apply_packed(variables, values, indices, PACKED_KS, 1.0, 1.0)
    with pytest.raises(BAD, match=r"variables\[1\] must be a resource variable"):
        ops.sparse_sgd_apply_packed([variables[0], inits[1]], values, indices, [9, 2], 1.0, 1.0)


def fit(in_place: bool, monkeypatch, **options) -> tuple[list[np.ndarray], int, int]:
    """Weights and iterations after two epochs of TopK with an SGD schedule; how many
    in-place applies were traced."""
    traced = []
    real, packed = ops.sparse_sgd_apply, ops.sparse_sgd_apply_packed
    with monkeypatch.context() as patch:
        patch.setattr(ops, "sparse_sgd_apply", lambda *a: traced.append(1) or real(*a))
        patch.setattr(ops, "sparse_sgd_apply_packed", lambda *a: traced.append(1) or packed(*a))
        if not in_place:
            patch.setattr(sparse_sgd, "applies_in_place", lambda *args: False)
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((20,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(3)]
        )
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)
        opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(schedule), tfs.TopK(0.05), **options)
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x = np.random.default_rng(1).normal(size=(64, 20)).astype("float32")
        model.fit(x, np.arange(64) % 3, batch_size=16, epochs=2, verbose=0)
    return [w.numpy() for w in model.weights], int(opt.iterations.numpy()), len(traced)


@pytest.mark.parametrize("options", [{}, {"skip_1d": True}])
def test_fit_in_place_equals_the_dense_path(compiled, monkeypatch, options):
    """model.fit, one device: bit-identical weights and step count (the schedule reads the
    step before it advances), with and without dense units (biases) in the same step."""
    sparse, sparse_steps, traced = fit(True, monkeypatch, **options)
    dense, dense_steps, none = fit(False, monkeypatch, **options)
    assert traced > 0 and none == 0
    assert sparse_steps == dense_steps == 8
    for a, b in zip(sparse, dense, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "inner",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.SGD(0.1, weight_decay=1e-4),
        lambda: keras.optimizers.SGD(0.1, clipnorm=1.0),
        lambda: keras.optimizers.SGD(0.1, clipvalue=1.0),
        lambda: keras.optimizers.SGD(0.1, global_clipnorm=1.0),
        lambda: keras.optimizers.SGD(0.1, use_ema=True),
        lambda: keras.optimizers.SGD(0.1, loss_scale_factor=2.0),
        lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
        lambda: keras.optimizers.Adam(0.1),
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
    ],
)
def test_in_place_only_for_plain_sgd(compiled, inner):
    variables = [keras.Variable(np.zeros((4, 4), "float32"))]
    assert sparse_sgd.applies_in_place(keras.optimizers.SGD(0.1), variables)
    assert not sparse_sgd.applies_in_place(inner(), variables)


def test_not_in_place_for_constrained_variables_or_under_a_strategy(compiled, mirrored2):
    plain = keras.optimizers.SGD(0.1)
    constrained = keras.Variable(np.zeros((4, 4), "float32"))
    constrained.constraint = keras.constraints.NonNeg()
    assert not sparse_sgd.applies_in_place(plain, [constrained])
    with mirrored2.scope():
        variables = [keras.Variable(np.zeros((4, 4), "float32"))]
        assert not sparse_sgd.applies_in_place(plain, variables)
