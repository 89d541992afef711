"""XLA-compiled steps (``jit_compile=True``, ``tf.function(jit_compile=True)``).

No custom kernel runs under XLA: the ops fall back to the pure-TF reference there, silently
(also under ``TF_SPARSIFY_REQUIRE_OPS=1``), and must give the kernels' results. Random choices
must not depend on ``jit_compile`` either (XLA's stateless random ops give other numbers for
the same seed). On CPU XLA: ``model.fit`` with every single-device compressor against the same
fit without XLA, each op inside ``tf.function(jit_compile=True)`` against its kernel, sparse
gradients (their touched rows padded under XLA) against the same rows without it; and steps
XLA cannot compile (Horovod's ops, SparseAllReduce's data-dependent sizes): Keras'
``jit_compile="auto"`` resolves to ``False`` for them, ``True`` fails at the first step with a
ValueError naming ``jit_compile=False`` (no ``hvd.init`` needed; the same check under
``horovodrun`` is ``xla_rejected`` in ``tests/test_horovod.py``).
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
import tf_sparsify.ops as ops
from tests.dtypes import DTYPES, UINT
from tests.embedding_model import TARGETS, TOKENS, embedding_model
from tf_sparsify.collectives import LocalCollective
from tf_sparsify.keras import sparse_sgd
from tf_sparsify.ops import library, xla

pytestmark = pytest.mark.xla  # compiles a step with XLA per test

RNG = np.random.default_rng(7)
X = RNG.standard_normal((64, 12)).astype(np.float32)
Y = RNG.standard_normal((64, 3)).astype(np.float32)
#: three steps of fixed gradients for a [40, 5] kernel and a [5] bias
GRADS = [
    (RNG.standard_normal((40, 5)).astype(np.float32), RNG.standard_normal(5).astype(np.float32))
    for _ in range(3)
]

COMPRESSORS = {
    "topk_ef": lambda: (tfs.TopK(ratio=0.1), None),
    "topk_no_ef": lambda: (tfs.TopK(k=5), False),
    "topk_float16_values": lambda: (tfs.TopK(ratio=0.2, value_dtype="float16"), None),
    "topk_bfloat16_values": lambda: (tfs.TopK(ratio=0.2, value_dtype="bfloat16"), None),
    "qsgd_buckets": lambda: (tfs.QSGD(levels=4, bucket_size=50, seed=3), None),
    "qsgd_int16_levels": lambda: (tfs.QSGD(levels=300, seed=4), None),
    "randomk": lambda: (tfs.RandomK(0.3, seed=5), None),
    "terngrad": lambda: (tfs.TernGrad(seed=6), None),
    "scaled_sign": lambda: (tfs.ScaledSign(), None),
    "fp16": lambda: (tfs.FP16(), None),
    "bf16": lambda: (tfs.BF16(), None),
    "identity": lambda: (tfs.Identity(), None),
    "powersgd": lambda: (tfs.PowerSGD(rank=2, seed=7), None),
}


def make_model() -> keras.Model:
    keras.utils.set_random_seed(11)
    return keras.Sequential(
        [keras.Input((12,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
    )


def fit(name: str, jit_compile: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Weights and optimizer variables (residuals, compressor state, step) after 4 steps of
    ``model.fit`` with the compressor ``name`` and plain SGD."""
    compressor, error_feedback = COMPRESSORS[name]()
    model = make_model()
    optimizer = tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.1), compressor, error_feedback=error_feedback
    )
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    assert model.jit_compile is jit_compile
    model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return [v.numpy() for v in model.weights], [v.numpy() for v in optimizer.variables]


def bits(t: tf.Tensor) -> np.ndarray:
    """A tensor's values, floats as bit patterns (NaN payloads and signed zeros compare)."""
    return tf.bitcast(t, UINT[t.dtype.size]).numpy() if t.dtype.is_floating else t.numpy()


def assert_same(actual, expected, what: str = "") -> None:
    for a, e in zip(tf.nest.flatten(actual), tf.nest.flatten(expected), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape, what
        np.testing.assert_array_equal(bits(a), bits(e), err_msg=what)


def both(function, *args):
    """``function(*args)`` in ``tf.function`` (the kernels) and under XLA (the reference)."""
    return tf.function(function)(*args), tf.function(function, jit_compile=True)(*args)


def awkward(n: int, dtype: tf.DType, nan: bool = True) -> tf.Tensor:
    """Normal values with ties, zeros of both signs, denormals, huge values, Inf and NaN."""
    x = RNG.standard_normal(n)
    x[::5] = np.round(x[::5])  # ties
    x[1::9] = -0.0
    x[2::13] = 1e-41 if dtype != tf.float64 else 1e-310  # denormal
    x[3::17] = 1e30 if dtype != tf.float16 else 6e4
    x[4::31], x[6::37] = np.inf, -np.inf
    if nan:
        x[7::41] = np.nan
    return tf.constant(x, dtype)


# -- model.fit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_fit_with_xla_equals_fit_without(compiled, name):
    """Weights within float rounding (XLA's own matmuls and fusions round a little
    differently; Identity shows that part alone); residuals and compressor state, which hold
    differences of nearly equal numbers, within that rounding of the gradients (of order 1
    here) as it carries through PowerSGD's orthogonalization."""
    (weights, state), (want_weights, want_state) = fit(name, True), fit(name, False)
    for a, b in zip(weights, want_weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=name)
    for a, b in zip(state, want_state, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-5, err_msg=name)


def test_custom_loop_under_tf_function_jit_compile(compiled):
    """``optimizer.apply`` inside ``tf.function(jit_compile=True)``: TopK with error feedback
    on fixed gradients, three steps; residuals and weights as without XLA."""

    def run(jit_compile: bool) -> list[np.ndarray]:
        variables = [tf.Variable(tf.zeros([40, 5])), tf.Variable(tf.zeros([5]))]
        optimizer = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.5), tfs.TopK(ratio=0.05))
        optimizer.build(variables)

        @tf.function(jit_compile=jit_compile)
        def step(grads):
            optimizer.apply(grads, variables)

        for kernel, bias in GRADS:
            step([tf.constant(kernel), tf.constant(bias)])
        return [v.numpy() for v in variables + optimizer.variables]

    for a, b in zip(run(True), run(False), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# -- sparse gradients: the touched rows, padded under XLA -----------------------------------
ROWS_COMPRESSORS = {
    "topk_ef": lambda: tfs.TopK(ratio=0.25),
    "topk_k7": lambda: tfs.TopK(k=7),
    "topk_float16_values": lambda: tfs.TopK(ratio=0.2, value_dtype="float16"),
    "identity": tfs.Identity,
    "fp16": tfs.FP16,
    "bf16": tfs.BF16,
}
VOCAB, WIDTH = 20, 6


def sparse_steps() -> list[tuple[np.ndarray, np.ndarray]]:
    """12 steps of ``(indices, values)`` for a [20, 6] table: duplicates, every third step
    more indices (30) than rows, ties and a zero at step 4. Three index counts, so XLA
    compiles the step three times, not once per step."""
    rng = np.random.default_rng(5)
    steps = []
    for step in range(12):
        n = (30, 4, 9)[step % 3]
        indices = rng.integers(0, VOCAB, size=n).astype(np.int32)
        values = rng.standard_normal((n, WIDTH)).astype(np.float32)
        if step == 4:
            values[:2], values[2, 0] = np.round(values[:2]), 0.0
        steps.append((indices, values))
    return steps


class Twins(LocalCollective):
    """Two replicas in one, the other sending what this one sends (MirroredStrategy's
    collectives do not compile under XLA on CPU): rows that both replicas touch combined."""

    num_replicas, divisor = 2, 2.0

    def all_reduce_sum(self, tensors):
        return [t + t for t in tensors]

    def all_gather(self, tensors):
        return [tf.stack([t, t]) for t in tensors]

    def all_gather_rows(self, tensors):
        return [tf.concat([t, t], 0) for t in tensors]


class TwinsTransport(tfs.Transport):
    def collective(self, pipeline, units, present=None):
        return Twins()


def sparse_rows_run(name: str, jit_compile: bool, twins: bool) -> list[tf.Tensor]:
    """The table and its residual after the 12 :func:`sparse_steps` through SGD wrapped with
    the compressor ``name``, in a function whose index count is unknown when traced."""
    table = tf.Variable(np.random.default_rng(1).standard_normal((VOCAB, WIDTH)), dtype=tf.float32)
    optimizer = tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.1),
        ROWS_COMPRESSORS[name](),
        transport=TwinsTransport() if twins else None,
    )
    optimizer.build([table])
    signature = [tf.TensorSpec([None], tf.int32), tf.TensorSpec([None, WIDTH], tf.float32)]

    @tf.function(jit_compile=jit_compile, input_signature=signature)
    def step(indices, values):
        grad = tf.IndexedSlices(values, indices, tf.constant([VOCAB, WIDTH]))
        optimizer.apply_gradients([(grad, table)])

    for indices, values in sparse_steps():
        step(indices, values)
    residual = optimizer.residuals[0]
    return [tf.convert_to_tensor(table)] + (
        [] if residual is None else [tf.convert_to_tensor(residual)]
    )


@pytest.mark.parametrize(
    "name, twins",
    [(name, False) for name in sorted(ROWS_COMPRESSORS)] + [("topk_ef", True), ("fp16", True)],
    ids=[*sorted(ROWS_COMPRESSORS), "topk_ef-two_replicas", "fp16-two_replicas"],
)
def test_sparse_rows_under_xla_equal_rows_without(name, twins):
    """An IndexedSlices gradient goes through the same touched-rows semantics under XLA
    (rows padded to the batch's bound): TopK's k from the touched entries, the same entries
    selected (ties to the lowest index), the same residual rows written; bit for bit, also
    with two replicas' rows combined."""
    assert_same(sparse_rows_run(name, True, twins), sparse_rows_run(name, False, twins), name)


def fit_embedding(compressor: tfs.Compressor, jit_compile: bool) -> list[np.ndarray]:
    """The embedding and its residual after 12 steps of ``model.fit`` (SGD, batches of 8)."""
    model = embedding_model()
    optimizer = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.5), compressor)
    model.compile(optimizer, "mse", jit_compile=jit_compile)
    model.fit(TOKENS, TARGETS, batch_size=8, epochs=3, shuffle=False, verbose=0)
    return [model.weights[0].numpy(), optimizer.residuals[0].numpy()]


@pytest.mark.parametrize(
    "make", [lambda: tfs.TopK(ratio=0.25), tfs.FP16, tfs.BF16], ids=["topk", "fp16", "bf16"]
)
def test_fit_on_an_embedding_with_xla_equals_fit_without(compiled, make):
    """The embedding's gradient stays rows under XLA: weights and residuals within XLA's own
    rounding of the dense layers (densified under XLA, TopK selected over the whole table and
    the casts sent every row's residual: the embeddings differed by 1e-2 and 1e-4)."""
    got, want = fit_embedding(make(), True), fit_embedding(make(), False)
    assert want[1].any()
    for a, b, what in zip(got, want, ["embedding", "residual"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=what)


def test_jit_compile_auto_turns_xla_on_where_a_gpu_is_seen_and_fit_runs(compiled, monkeypatch):
    """Keras resolves ``"auto"`` to XLA on machines with a GPU: pretend one at compile."""
    gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    devices = tf.config.list_physical_devices()
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda *a: devices + [gpu])
    model = make_model()
    model.compile(
        optimizer=tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.1)),
        loss="mse",
    )
    monkeypatch.undo()
    assert model.jit_compile is True
    history = model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_sparse_sgd_is_not_applied_in_place_under_xla(compiled):
    """Under XLA the dense update (which XLA fuses) replaces the SparseSgdApply kernel."""
    variables = [tf.Variable(tf.zeros([8]))]
    sgd = keras.optimizers.SGD(0.1)
    seen = {}

    def probe(key):
        seen[key] = sparse_sgd.applies_in_place(sgd, variables)
        return tf.constant(0)

    tf.function(probe)("plain")
    tf.function(probe, jit_compile=True)("xla")
    assert seen == {"plain": True, "xla": False}


# -- the ops inside tf.function(jit_compile=True) -------------------------------------------
def test_xla_context_is_seen_in_nested_functions_loops_and_branches():
    found = []

    def look() -> tf.Tensor:
        found.append(ops.in_xla_context())
        return tf.constant(0)

    def outer(x):
        look()
        tf.function(look)()
        tf.cond(x > 0, look, look)
        tf.while_loop(lambda i: i < 1, lambda i: i + 1 + look(), [tf.constant(0)])
        return x

    tf.function(outer, jit_compile=True)(tf.constant(1))
    assert len(found) == 5 and all(found)
    found.clear()
    tf.function(outer)(tf.constant(1))
    assert len(found) == 5 and not any(found)


@pytest.mark.parametrize("nan", [False, True], ids=["finite_and_inf", "with_nan"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_error_feedback_under_xla_equals_kernel(compiled, dtype, nan):
    """Without NaN, XLA's float32 top-k ranks the magnitudes; with NaN, the integer keys."""
    grad, residual = awkward(3001, dtype, nan), awkward(3001, dtype, nan)
    for k in (0, 1, 40, 777, 3001):
        plain, jitted = both(lambda g, r, k=k: ops.topk_error_feedback(g, r, k), grad, residual)
        assert_same(jitted, plain, f"{dtype.name} k={k}")
    # (a residual as an input: XLA folds ``g + zeros_like(g)`` to ``g``, keeping -0.0 there)
    shaped = tf.reshape(grad[:3000], [30, 100])
    plain, jitted = both(lambda g, r: ops.topk_error_feedback(g, r, 33), shaped, shaped * 0)
    assert_same(jitted, plain, f"{dtype.name} rank 2")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("levels", "bucket_size"), [(4, 0), (127, 64), (300, 7), (5, 5000)])
def test_qsgd_under_xla_equals_kernel(compiled, dtype, levels, bucket_size):
    x = tf.reshape(awkward(1001, dtype)[:1000], [10, 100])
    seed = tf.constant(-1234567890123, tf.int64)

    def roundtrip(t):
        signed, norms = ops.qsgd_quantize(t, levels, bucket_size, seed)
        return (
            signed,
            norms,
            ops.qsgd_dequantize(signed, norms, levels, bucket_size, t.shape, t.dtype),
        )

    plain, jitted = both(roundtrip, x)
    assert_same(jitted, plain, f"{dtype.name} levels={levels} bucket={bucket_size}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64])
def test_scatter_sum_under_xla_equals_kernel(compiled, dtype, index_dtype):
    """Duplicates (several replicas' indices) add in input order on both."""
    values = tf.constant(RNG.standard_normal(600) * 100, dtype)
    indices = tf.constant(RNG.integers(0, 97, 600), index_dtype)
    plain, jitted = both(lambda v, i: ops.scatter_sum(v, i, 97), values, indices)
    assert_same(jitted, plain, f"{dtype.name} {index_dtype.name}")


@pytest.mark.parametrize(("n", "k"), [(1, 1), (1000, 1), (1000, 10), (100003, 1000), (64, 64)])
def test_index_code_under_xla_equals_kernel(compiled, n, k):
    indices = tf.constant(np.sort(RNG.choice(n, k, replace=False)), tf.int32)

    def roundtrip(i):
        code = ops.encode_indices(i, n)
        stacked = tf.stack([code, code])  # a gathered [replicas, bytes] stack
        return code, ops.decode_indices(code, n, k), ops.decode_indices(stacked, n, k)

    plain, jitted = both(roundtrip, indices)
    assert_same(jitted, plain, f"n={n} k={k}")
    np.testing.assert_array_equal(jitted[1].numpy(), indices.numpy())


def test_sparse_sgd_apply_under_xla_equals_kernel(compiled):
    values = tf.constant(RNG.standard_normal((2, 30)), tf.float32)
    rows = [np.sort(RNG.choice(500, 30, replace=False)) for _ in range(2)]
    indices = tf.constant(np.stack(rows), tf.int64)
    start = RNG.standard_normal((50, 10)).astype(np.float32)

    def step(variable: tf.Variable) -> tf.Tensor:
        ops.sparse_sgd_apply(variable, values, indices, 0.5, 0.1)
        return variable.read_value()

    plain, jitted = tf.Variable(start), tf.Variable(start)
    assert_same(tf.function(step, jit_compile=True)(jitted), tf.function(step)(plain))


@pytest.mark.parametrize(
    "seed", [[1, 2], [12345, -678], [2**40, 99], [-1, -(2**62)]], ids=["small", "neg", "big", "top"]
)
def test_stateless_draws_do_not_depend_on_xla(seed):
    """Uniforms and integers bit for bit; normals within one float32 rounding (C's logf and
    sincosf are not always correctly rounded)."""
    seed = tf.constant(seed, tf.int64)

    def draws(s):
        return (
            xla.stateless_uniform([37, 3], s),
            xla.stateless_uniform_int([1001], s, 2**31 - 1),
            xla.stateless_normal([5, 3], s, tf.float64),
            xla.stateless_normal([7], s, tf.float16),
            xla.stateless_normal([4, 4], s, tf.bfloat16),
        )

    plain, jitted = both(draws, seed)
    assert_same(jitted, plain)
    tf_ops = (
        tf.random.stateless_uniform([37, 3], seed),
        tf.random.stateless_uniform([1001], seed, minval=0, maxval=2**31 - 1, dtype=tf.int32),
    )
    assert_same(plain[:2], tf_ops)
    normal = both(lambda s: xla.stateless_normal([999], s, tf.float32), seed)
    np.testing.assert_array_max_ulp(normal[1].numpy(), normal[0].numpy(), maxulp=2)


@pytest.mark.parametrize(
    "key, data",
    [([1, 2], 0), ([12345, -678], 7), ([2**40, 99], 2**33), ([-1, -(2**62)], -5)],
    ids=["small", "neg", "big", "top"],
)
def test_fold_in_is_tensorflows_with_and_without_xla(key, data):
    """One kernel outside XLA, TensorFlow's own function under it: both give TensorFlow's
    ``stateless_fold_in(alg="philox")``, eagerly too."""
    key, data = tf.constant(key, tf.int64), tf.constant(data, tf.int64)
    expected = tf.random.experimental.stateless_fold_in(key, data, alg="philox")
    plain, jitted = both(xla.fold_in, key, data)
    assert_same((xla.fold_in(key, data), plain, jitted), (expected,) * 3)


def test_require_ops_does_not_raise_or_warn_under_xla(monkeypatch):
    """With the library missing and TF_SPARSIFY_REQUIRE_OPS=1, ops outside XLA raise; under
    XLA the reference is what runs anyway: no error, no warning."""
    monkeypatch.setattr(ops, "_library", lambda: library.Library(None, "pretend it is missing"))
    monkeypatch.setattr(ops, "_warned", False)
    monkeypatch.setenv(ops.REQUIRE_ENV, "1")
    grad = tf.constant(RNG.standard_normal(100), tf.float32)

    def compress(g):
        values, indices, residual = ops.topk_error_feedback(g, tf.zeros_like(g), 5)
        levels, norms = ops.qsgd_quantize(g, 4, 0, tf.constant(1, tf.int64))
        return ops.scatter_sum(values, indices, 100), residual, levels, norms

    with pytest.raises(RuntimeError, match="TF_SPARSIFY_REQUIRE_OPS=1"):
        tf.function(compress)(grad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tf.function(compress, jit_compile=True)(grad)


# -- steps XLA cannot compile: Horovod's ops, SparseAllReduce's data-dependent sizes ----------
def cannot_compile(name: str) -> keras.optimizers.Optimizer:
    import tf_sparsify.horovod as th

    sgd = keras.optimizers.SGD(0.1)
    if name == "horovod":
        return th.DistributedOptimizer(sgd, tfs.TopK(k=2))
    return tfs.SparsifiedOptimizer(sgd, tfs.SparseAllReduce(k=2))


def test_auto_resolves_to_no_xla_where_the_step_cannot_compile(monkeypatch):
    """Where Keras' ``"auto"`` turns XLA on (a GPU is seen), not for Horovod's optimizer or
    SparseAllReduce, also under a LossScaleOptimizer; other models resolve as before."""
    gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda *a: [gpu])
    optimizers = {
        "horovod": lambda: cannot_compile("horovod"),
        "sparse_allreduce": lambda: cannot_compile("sparse_allreduce"),
        "loss_scaled": lambda: keras.optimizers.LossScaleOptimizer(cannot_compile("horovod")),
        "sparsified": lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=2)),
        "sgd": lambda: keras.optimizers.SGD(0.1),
    }
    resolved = {}
    for name, optimizer in optimizers.items():
        model = make_model()
        model.compile(optimizer=optimizer(), loss="mse")
        resolved[name] = model.jit_compile
    assert resolved == {
        "horovod": False,
        "sparse_allreduce": False,
        "loss_scaled": False,
        "sparsified": True,
        "sgd": True,
    }


@pytest.mark.parametrize("name", ["horovod", "sparse_allreduce"])
def test_jit_compile_true_fails_at_the_first_step_naming_the_fix(name):
    """Our ValueError while the first step is traced, not XLA's after it; Horovod's before
    Horovod is even asked for its size (no ``hvd.init`` in this process)."""
    model = make_model()
    model.compile(optimizer=cannot_compile(name), loss="mse", jit_compile=True)
    with pytest.raises(ValueError, match="jit_compile=False"):
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0)


@pytest.mark.parametrize("hook", ["collective", "fp16_compression", "topk_compression"])
def test_horovod_collective_and_compression_hooks_name_the_fix(hook):
    import tf_sparsify.horovod as th

    hooks = {
        "collective": lambda t: th.HorovodCollective(),
        "fp16_compression": lambda t: th.FP16Compression().compress(t),
        "topk_compression": lambda t: th.TopKCompression(k=2).compress(t),
    }
    with pytest.raises(ValueError, match="jit_compile=False"):
        tf.function(hooks[hook], jit_compile=True)(tf.ones([4]))
