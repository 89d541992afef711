"""``SparseAllReduce`` under ``horovodrun -np P`` (P = 2 and 3): updates and residuals against the
NumPy reference of the algorithm, bytes handed to Horovod, the dense fallback, conservation
in float64, a non-finite step, ranks configured differently, and ``model.fit``.

Every rank knows every rank's gradients (seeded by step), so each rank runs the reference of
all ranks itself.
"""

from __future__ import annotations

import time

import keras
import numpy as np
import tensorflow as tf
from common import Checks, assert_close, hvd, train_step

import tf_sparsify as tfs
import tf_sparsify.horovod as th
from tests import sparse_allreduce_reference as reference

SIZE, RANK = hvd.size(), hvd.rank()
STEPS = 3


def random_grads(shape: tuple, dtype: str, seed: int) -> np.ndarray:
    """``[STEPS, SIZE, *shape]``."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(STEPS, SIZE, *shape)).astype(dtype)


def crowded_grads(shape: tuple, dtype: str, seed: int) -> np.ndarray:
    """Gradients whose large entries crowd into the first slice: its owner's support is
    dense (it sends the slice dense), the other owners' supports are not."""
    grads = random_grads(shape, dtype, seed)
    first = int(np.prod(shape)) // SIZE
    flat = grads.reshape(STEPS, SIZE, -1)
    flat[:, :, :first] *= 100
    return flat.reshape(grads.shape)


def integer_grads(shape: tuple, dtype: str, seed: int) -> np.ndarray:
    """Small integers: exact in every float type and in their sums."""
    rng = np.random.default_rng(seed)
    return rng.integers(-8, 9, size=(STEPS, SIZE, *shape)).astype(dtype)


def run_both(compressor, grads: list[np.ndarray], dtypes: list[str], k: int) -> dict:
    """DistributedOptimizer (in a tf.function, as model.fit) and GradientExchange (eagerly) on
    the same gradients: each update and this rank's residuals against the reference, and the
    bytes handed to Horovod against the reference's. The reference runs bfloat16 tensors in
    float16 (the same bytes; their integer gradients are exact in both); only the division
    by the size rounds differently, so their updates are compared to bfloat16's precision."""
    shapes = [g.shape[2:] for g in grads]
    want = [
        reference.run(
            g.reshape(STEPS, SIZE, -1).astype(np.float16 if d == "bfloat16" else d), k, SIZE
        )
        for g, d in zip(grads, dtypes, strict=True)
    ]
    variables = [keras.Variable(np.zeros(s), dtype=d) for s, d in zip(shapes, dtypes, strict=True)]
    opt = th.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0), compressor)
    exchange = th.GradientExchange(compressor)
    apply = train_step(opt, variables)

    dense_owners = 0
    for t in range(STEPS):
        mine = [tf.constant(g[t, RANK], dtype=d) for g, d in zip(grads, dtypes, strict=True)]
        for v in variables:  # from zero, the variable after the step is exactly -update
            v.assign(tf.zeros_like(v))
        apply(mine)
        tape_got = exchange.updates(mine, variables)
        for i, w in enumerate(want):
            update = np.reshape(w[t].update.astype(np.float64), shapes[i])
            rtol = 2.0**-7 if dtypes[i] == "bfloat16" else 0
            got = -tf.cast(variables[i], tf.float64)
            assert_close(got, update, f"optimizer update {i} step {t}", rtol, 0)
            assert_close(
                tf.cast(tape_got[i], tf.float64), update, f"tape update {i} step {t}", rtol, 0
            )
            dense_owners += sum(w[t].dense)
    for i, w in enumerate(want):
        mine = np.reshape(w[-1].residuals[RANK].astype(np.float64), shapes[i])
        for front in (opt, exchange):
            assert_close(tf.cast(front.residuals[i], tf.float64), mine, f"residual {i}", 0, 0)
    handed = sum(sum(step.sent[RANK]) for w in want for step in w)
    for front in (opt, exchange):
        if int(front.bytes_to_horovod.numpy()) != handed:
            raise AssertionError(
                f"bytes to Horovod {int(front.bytes_to_horovod.numpy())}: {handed}"
            )
    first_round = sum(step.sent[RANK][0] for w in want for step in w)
    if int(opt.bytes_sent.numpy()) != first_round:
        raise AssertionError(f"bytes_sent {int(opt.bytes_sent.numpy())} != {first_round}")
    return {"bytes_to_horovod": handed, "dense_owners": dense_owners}


def check_exact() -> dict:
    """Several tensors in one bucket (one all-to-all each, one grouped all-gather of bytes),
    float32 and float16, slices of unequal length (35 and 7 entries are not divisible by 3)."""
    grads = [
        random_grads((7, 5), "float32", 1),
        random_grads((7,), "float32", 2),
        random_grads((4, 6), "float16", 3),
        integer_grads((5, 5), "float32", 4),
    ]
    dtypes = ["float32", "float32", "float16", "bfloat16"]
    return run_both(tfs.SparseAllReduce(k=6), grads, dtypes, 6)


def check_dense_fallback() -> dict:
    """The first owner's support is dense, the others' are not (on 2 ranks): both formats in
    one all-gather, also for a bfloat16 tensor (int16 bits in Horovod)."""
    grads = [crowded_grads((60,), "float32", 5), integer_grads((40,), "float32", 6)]
    found = run_both(tfs.SparseAllReduce(k=36), grads, ["float32", "bfloat16"], 36)
    if found["dense_owners"] == 0:
        raise AssertionError("no owner sent its slice dense")
    return found


def check_conservation() -> dict:
    """float64: sum of all gradients == size * (sum of the updates) + sum of the residuals."""
    grads = random_grads((9, 4), "float64", 7)
    variable = keras.Variable(np.zeros((9, 4)), dtype="float64")
    exchange = th.GradientExchange(tfs.SparseAllReduce(ratio=0.2))
    applied = np.zeros((9, 4))
    for t in range(STEPS):
        (update,) = exchange.updates([tf.constant(grads[t, RANK])], [variable])
        applied += update.numpy()
    residuals = hvd.allgather_object(exchange.residuals[0].numpy())
    gap = np.abs(grads.sum(axis=(0, 1)) - SIZE * applied - np.sum(residuals, axis=0)).max()
    if gap > 1e-12:
        raise AssertionError(f"not conserved: max gap {gap}")
    return {"gap": float(gap)}


def check_non_finite() -> dict:
    """A NaN on the last rank at step 1: every rank sees a bad step and keeps its residuals;
    step 2 then equals the reference run without step 1."""
    grads = random_grads((5, 4), "float32", 8)
    bad = grads.copy()
    bad[1, SIZE - 1, 2, 3] = np.nan
    variable = keras.Variable(np.zeros((5, 4)), dtype="float32")
    exchange = th.GradientExchange(tfs.SparseAllReduce(k=4))
    updates = [exchange.updates([tf.constant(bad[t, RANK])], [variable])[0] for t in range(STEPS)]
    if np.all(np.isfinite(updates[1].numpy())):
        raise AssertionError("the bad step's update is finite")
    want = reference.run(grads[[0, 2]].reshape(2, SIZE, -1), 4, SIZE)
    assert_close(updates[2].numpy().ravel(), want[1].update, "update after the bad step", 0, 0)
    assert_close(exchange.residuals[0].numpy().ravel(), want[1].residuals[RANK], "residual", 0, 0)
    return {}


def expect_mismatch(compressor) -> dict:
    variable = keras.Variable(np.zeros((6, 4)), dtype="float32")
    exchange = th.GradientExchange(compressor)
    start = time.perf_counter()
    try:
        exchange.updates([tf.ones((6, 4))], [variable])
    except tf.errors.InvalidArgumentError as error:
        if "differ in their compressor" not in str(error):
            raise AssertionError(f"the error does not name the compressor: {error}") from error
        return {"seconds": round(time.perf_counter() - start, 2)}
    raise AssertionError("no error although the ranks differ")


def check_fit() -> dict:
    """model.fit with DistributedOptimizer(SparseAllReduce): the loss falls and the ranks'
    weights stay equal."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(3)])
    rng = np.random.default_rng(20 + RANK)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0)
    opt = th.DistributedOptimizer(keras.optimizers.SGD(0.1), tfs.SparseAllReduce(ratio=0.1))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=opt, loss=loss, jit_compile=False)
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0)
    losses = history.history["loss"]
    if not losses[-1] < losses[0]:
        raise AssertionError(f"the loss did not fall: {losses}")
    weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    if not all(np.array_equal(weights, w) for w in hvd.allgather_object(weights)):
        raise AssertionError("the ranks' weights differ")
    return {"losses": losses}


def main() -> None:
    checks = Checks()
    checks.run("exact", check_exact)
    checks.run("dense_fallback", check_dense_fallback)
    checks.run("conservation", check_conservation)
    checks.run("non_finite", check_non_finite)
    checks.run("mismatch_k", lambda: expect_mismatch(tfs.SparseAllReduce(k=3 + RANK)))
    other = tfs.TopK(k=3) if RANK == 0 else tfs.SparseAllReduce(k=3)
    checks.run("mismatch_compressor", lambda: expect_mismatch(other))
    checks.run("fit", check_fit)
    checks.exit()


if __name__ == "__main__":
    main()
