"""Exact checks under ``horovodrun -np 2``: updates against a hand computation, bytes, Identity
against plain Horovod averaging, TopK applied in place against the dense path, the Horovod
``compression=`` classes and the callbacks.

Every rank knows every rank's gradients (they are seeded by rank and step), so each rank
computes the expected averaged update itself with the compressors called directly.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from common import Checks, assert_close, hvd, train_step

import tf_sparsify as tfs
import tf_sparsify.horovod as th
from tests.powersgd_reference import numpy_powersgd
from tf_sparsify.keras import sparse_sgd

SIZE, RANK = hvd.size(), hvd.rank()
SHAPES = [(6, 5), (5,), (5, 3), (3,)]
STEPS = 2

# name -> (compressor, pipeline options)
CONFIGS = {
    "topk_ef_min_size": (lambda: tfs.TopK(k=3), {"min_size": 4}),
    "topk_global": (lambda: tfs.TopK(ratio=0.2), {"scope": "global"}),
    "randomk": (lambda: tfs.RandomK(0.5, seed=3), {}),
    "qsgd_int8": (lambda: tfs.QSGD(levels=4, seed=1), {}),
    "qsgd_int16": (lambda: tfs.QSGD(levels=200, bucket_size=8), {}),
    "terngrad_uint8": (lambda: tfs.TernGrad(seed=2), {}),
    "sign_ef": (lambda: tfs.ScaledSign(), {}),
    "bf16_ef": (lambda: tfs.BF16(), {}),
    "fp16": (lambda: tfs.FP16(), {"error_feedback": False}),
    "identity": (lambda: tfs.Identity(), {}),
}


def grads_of(rank: int, step: int) -> list[tf.Tensor]:
    rng = np.random.default_rng(100 * rank + step)
    return [tf.constant(rng.normal(size=s).astype("float32")) for s in SHAPES]


def reference(compressor, options: dict) -> tuple[list[list[np.ndarray]], list[np.ndarray]]:
    """Per step, the mean over ranks of decompress(compress(g_p + e_p)); this rank's residuals.

    Written out from the definitions: scope, min_size and error feedback by hand, the
    compressors called directly with the keys (seed, step, tensor, rank).
    """
    ef = options.get("error_feedback", not compressor.unbiased)
    min_size = options.get("min_size", 0)
    global_scope = options.get("scope") == "global"
    residuals = {p: None for p in range(SIZE)}
    updates = []
    for step in range(STEPS):
        per_rank = []
        for p in range(SIZE):
            grads = grads_of(p, step)
            if global_scope:
                tensors = [tf.concat([tf.reshape(g, [-1]) for g in grads], 0)]
                plan = [(0, compressor, ef)]
            else:
                tensors = grads
                plan = [
                    (i, compressor, ef) if g.shape.num_elements() >= min_size else (i, None, False)
                    for i, g in enumerate(grads)
                ]
            if residuals[p] is None:
                residuals[p] = [tf.zeros_like(t) for t in tensors]
            sent = []
            for (tensor_id, codec, use_ef), t in zip(plan, tensors, strict=True):
                if codec is None:
                    sent.append((None, (t,), None))
                    continue
                acc = t + residuals[p][tensor_id] if use_ef else t
                payload, ctx = codec.compress(acc, step, tensor_id, p)
                if use_ef:
                    residuals[p][tensor_id] = acc - codec.decompress(payload, ctx)
                sent.append((codec, payload, ctx))
            per_rank.append(sent)
        step_updates = []
        for j in range(len(per_rank[0])):
            codec, _, ctx = per_rank[0][j]
            payloads = [per_rank[p][j][1] for p in range(SIZE)]
            if codec is None:
                total = tf.add_n([pl[0] for pl in payloads])
            elif codec.summable:  # summed on the wire (bfloat16 via float32), then decompressed
                summed = tuple(
                    tf.cast(tf.add_n([tf.cast(pl[k], tf.float32) for pl in payloads]), t.dtype)
                    for k, t in enumerate(payloads[0])
                )
                total = codec.decompress(summed, ctx)
            else:
                total = tf.add_n([codec.decompress(pl, ctx) for pl in payloads])
            step_updates.append(total / SIZE)
        if global_scope:
            step_updates = tf.split(step_updates[0], [int(np.prod(s)) for s in SHAPES])
        updates.append(
            [np.reshape(u.numpy(), s) for u, s in zip(step_updates, SHAPES, strict=True)]
        )
    mine = residuals[RANK]
    if global_scope:
        mine = tf.split(mine[0], [int(np.prod(s)) for s in SHAPES])
    return updates, [np.reshape(np.asarray(r), s) for r, s in zip(mine, SHAPES, strict=True)]


def horovod_ops(step, grads: list[tf.Tensor]) -> dict[str, int]:
    """Horovod ops by type in the traced ``step``, its branches included."""
    graph = step.get_concrete_function(grads).graph.as_graph_def()
    nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    return dict(Counter(n.op for n in nodes if n.op.startswith("Horovod")))


def check_config(name: str) -> dict:
    make, options = CONFIGS[name]
    expected, expected_residuals = reference(make(), options)
    tol = {"rtol": 1e-5, "atol": 1e-5}

    # Keras wrapper, in a tf.function like model.fit's train step.
    variables = [keras.Variable(np.zeros(s, "float32")) for s in SHAPES]
    opt = th.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0), make(), **options)

    apply = train_step(opt, variables)

    # Custom-loop exchange, eagerly.
    exchange = th.GradientExchange(make(), **options)
    for step in range(STEPS):
        before = [v.numpy() for v in variables]
        apply(grads_of(RANK, step))
        got = [b - v.numpy() for b, v in zip(before, variables, strict=True)]
        tape_got = exchange.updates(grads_of(RANK, step), variables)
        for i in range(len(SHAPES)):
            assert_close(got[i], expected[step][i], f"optimizer update {i} step {step}", **tol)
            assert_close(tape_got[i], expected[step][i], f"tape update {i} step {step}", **tol)
    for i, r in enumerate(opt.residuals):
        want = expected_residuals[i] if r is not None else None
        if r is not None:
            assert_close(r.numpy(), want, f"optimizer residual {i}", **tol)
            assert_close(exchange.residuals[i].numpy(), want, f"exchange residual {i}", **tol)
    horovod_bytes = int(opt.bytes_to_horovod.numpy())
    wire = int(opt.bytes_sent.numpy())
    if not horovod_bytes == wire == STEPS * opt.wire_bytes_per_step:
        raise AssertionError(
            f"bytes to Horovod {horovod_bytes}, bytes_sent {wire}, "
            f"wire_bytes_per_step x steps {STEPS * opt.wire_bytes_per_step}"
        )
    tape_bytes = int(exchange.bytes_to_horovod.numpy())
    if not tape_bytes == int(exchange.bytes_sent.numpy()) == STEPS * exchange.wire_bytes_per_step:
        raise AssertionError(f"exchange bytes to Horovod {tape_bytes} != its wire bytes")
    return {
        "bytes_to_horovod": horovod_bytes,
        "bytes_sent": wire,
        "wire_bytes_per_step": opt.wire_bytes_per_step,
        "dense_bytes_per_step": opt.dense_bytes_per_step,
        "horovod_ops": horovod_ops(apply, grads_of(RANK, 0)),
    }


def check_late_buckets() -> dict:
    """Every bucket one step late: the synchronous reference's updates a step later (zero at
    step 0), the last one applied by the flush; the residuals as the reference's."""
    make, options = CONFIGS["topk_ef_min_size"]
    expected, expected_residuals = reference(make(), options)
    expected = [[np.zeros(s, "float32") for s in SHAPES], *expected]
    variables = [keras.Variable(np.zeros(s, "float32")) for s in SHAPES]
    opt = th.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=1.0), make(), late_buckets="all", **options
    )
    apply = train_step(opt, variables)
    exchange = th.GradientExchange(make(), late_buckets="all", **options)
    for step in range(STEPS + 1):
        before = [v.numpy() for v in variables]
        if step < STEPS:
            apply(grads_of(RANK, step))
            tape_got = exchange.updates(grads_of(RANK, step), variables)
        else:
            tf.function(opt.apply_in_flight)()
            tape_got = exchange.in_flight_updates(variables)
        got = [b - v.numpy() for b, v in zip(before, variables, strict=True)]
        for i in range(len(SHAPES)):
            assert_close(got[i], expected[step][i], f"optimizer update {i} step {step}")
            assert_close(tape_got[i], expected[step][i], f"tape update {i} step {step}")
    for i, r in enumerate(opt.residuals):
        if r is not None:
            assert_close(r.numpy(), expected_residuals[i], f"optimizer residual {i}")
            assert_close(exchange.residuals[i].numpy(), expected_residuals[i], f"residual {i}")
    return {"horovod_ops": horovod_ops(apply, grads_of(RANK, 0))}


def check_powersgd() -> dict:
    """PowerSGD(2) in DistributedOptimizer and GradientExchange: the (6, 5) gradient's update
    (the mean over ranks approximated: divisor = size), this rank's residual and Q against
    NumPy; the others (vectors, and (5, 3) where rank 2 does not pay) averaged exactly; the
    bytes handed to Horovod == bytes_sent == r (n + m) floats + the dense tensors."""
    grads = [
        np.stack([[grads_of(p, t)[i].numpy() for p in range(SIZE)] for t in range(STEPS)])
        for i in range(len(SHAPES))
    ]
    expected = numpy_powersgd(grads[0], 2, divisor=SIZE, draw_dtype=tf.float32)
    variables = [keras.Variable(np.zeros(s, "float32")) for s in SHAPES]
    opt = th.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0), tfs.PowerSGD(2))
    exchange = th.GradientExchange(tfs.PowerSGD(2))

    apply = train_step(opt, variables)

    for step in range(STEPS):
        before = [v.numpy() for v in variables]
        apply(grads_of(RANK, step))
        got = [b - v.numpy() for b, v in zip(before, variables, strict=True)]
        tape_got = exchange.updates(grads_of(RANK, step), variables)
        wanted = [expected[step][0]] + [g[step].mean(axis=0) for g in grads[1:]]
        for i, want in enumerate(wanted):
            assert_close(got[i], want, f"optimizer update {i} step {step}")
            assert_close(tape_got[i], want, f"tape update {i} step {step}")
    (q,) = (v for v in opt.variables if "_state" in v.name)
    assert_close(q.numpy(), expected[-1][2], "Q")
    assert_close(opt.residuals[0].numpy(), expected[-1][1][RANK], "optimizer residual")
    assert_close(exchange.residuals[0].numpy(), expected[-1][1][RANK], "exchange residual")
    wire = 4 * (2 * (6 + 5) + 5 + 5 * 3 + 3)
    for front in (opt, exchange):
        sent = (int(front.bytes_to_horovod.numpy()), int(front.bytes_sent.numpy()))
        if sent != (STEPS * wire, STEPS * wire) or front.wire_bytes_per_step != wire:
            raise AssertionError(f"bytes to Horovod, bytes_sent {sent}: want {STEPS * wire}")
    return {"wire_bytes_per_step": wire, "dense_bytes_per_step": opt.dense_bytes_per_step}


def check_exchange_checkpoint(tmp: str) -> dict:
    """tf.train.Checkpoint(exchange) carries residuals and step: restore-then-step equals
    stepping on."""
    make, options = CONFIGS["topk_ef_min_size"]
    variables = [keras.Variable(np.zeros(s, "float32")) for s in SHAPES]
    exchange = th.GradientExchange(make(), **options)
    exchange.updates(grads_of(RANK, 0), variables)
    path = tf.train.Checkpoint(exchange=exchange).save(f"{tmp}/rank{RANK}/ckpt")
    restored = th.GradientExchange(make(), **options)
    tf.train.Checkpoint(exchange=restored).restore(path)
    on = exchange.updates(grads_of(RANK, 1), variables)
    again = restored.updates(grads_of(RANK, 1), variables)
    assert int(restored.step.numpy()) == 2
    for i, (a, b) in enumerate(zip(on, again, strict=True)):
        assert_close(a, b, f"update {i} after restore", 0, 0)
    for a, b in zip(exchange.residuals, restored.residuals, strict=True):
        if a is not None:
            assert_close(a.numpy(), b.numpy(), "residual after restore", 0, 0)
    return {}


def check_tape_momentum_equals_optimizer() -> dict:
    """GradientExchange with DGC momentum correction == DistributedOptimizer with it: the same
    state core, so the same updates, residuals and momenta, step by step."""
    options = {"momentum_correction": 0.9, "min_size": 4}
    variables = [keras.Variable(np.zeros(s, "float32")) for s in SHAPES]
    opt = th.DistributedOptimizer(keras.optimizers.SGD(1.0), tfs.TopK(k=3), **options)
    exchange = th.GradientExchange(tfs.TopK(k=3), **options)

    apply = train_step(opt, variables)

    for step in range(4):
        before = [v.numpy() for v in variables]
        apply(grads_of(RANK, step))
        got = [b - v.numpy() for b, v in zip(before, variables, strict=True)]
        tape = exchange.updates(grads_of(RANK, step), variables)
        for i in range(len(SHAPES)):
            assert_close(tape[i], got[i], f"update {i} step {step}", 1e-6, 1e-7)
    for name in ("residuals", "momenta"):
        pairs = zip(getattr(opt, name), getattr(exchange, name), strict=True)
        for i, (a, b) in enumerate(pairs):
            if (a is None) != (b is None):
                raise AssertionError(f"{name} {i}: one side has no buffer")
            if a is not None:
                assert_close(b.numpy(), a.numpy(), f"{name} {i}", 1e-6, 1e-7)
    if not any(m is not None and np.any(m.numpy()) for m in exchange.momenta):
        raise AssertionError("the momentum buffers stayed zero")
    return {}


def check_sparse_sgd_equals_dense() -> dict:
    """With a plain SGD inner optimizer, TopK updates are applied in place from the gathered
    entries (no dense update is built): same variables as the dense path, step by step, within
    the rounding of ranks that sent the same index; biases (dense units) and a learning-rate
    schedule in the same steps."""
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, 1, 0.5)
    runs = {}
    for in_place in (True, False):
        variables = [keras.Variable(np.ones(s, "float32")) for s in SHAPES]
        opt = th.DistributedOptimizer(keras.optimizers.SGD(schedule), tfs.TopK(k=3), min_size=6)
        opt.build(variables)
        if in_place and not sparse_sgd.applies_in_place(opt.inner_optimizer, variables):
            raise AssertionError("plain SGD under Horovod does not take the in-place path")
        original = sparse_sgd.applies_in_place
        if not in_place:
            sparse_sgd.applies_in_place = lambda *args: False

        apply = train_step(opt, variables)
        try:
            history = []
            for step in range(3):
                apply(grads_of(RANK, step))
                history.append([v.numpy() for v in variables])
        finally:
            sparse_sgd.applies_in_place = original
        runs[in_place] = (history, int(opt.iterations.numpy()))
    (sparse, sparse_steps), (dense, dense_steps) = runs[True], runs[False]
    if (sparse_steps, dense_steps) != (3, 3):
        raise AssertionError(f"iterations {sparse_steps} in place, {dense_steps} dense; want 3")
    diff = 0.0
    for step in range(3):
        for i in range(len(SHAPES)):
            got = assert_close(sparse[step][i], dense[step][i], f"var {i} step {step}", 1e-6, 0)
            diff = max(diff, got)
        if np.array_equal(sparse[step][0], sparse[step - 1][0] if step else np.ones(SHAPES[0])):
            raise AssertionError(f"step {step} did not change the TopK variable")
    return {"max_abs_diff": diff}


# -- Identity against plain Horovod averaging ----------------------------------------------------
def make_model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
    )


def shard(seed: int = 7, n: int = 48):
    rng = np.random.default_rng(seed + RANK)
    return rng.normal(size=(n, 8)).astype("float32"), rng.integers(0, 3, n)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def check_identity_equals_horovod() -> dict:
    x, y = shard()
    model = make_model()
    model.compile(
        optimizer=th.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
        loss=LOSS,
        jit_compile=False,
    )
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    ref = make_model()
    sgd = keras.optimizers.SGD(0.1, momentum=0.9)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, ref(xb, training=True))
        grads = tape.gradient(loss, ref.trainable_variables)
        grads = [hvd.allreduce(g, op=hvd.Average) for g in grads]
        sgd.apply(grads, ref.trainable_variables)

    for _ in range(2):
        for b in range(0, len(x), 16):
            step(x[b : b + 16], y[b : b + 16])
    diff = 0.0
    for a, b in zip(model.trainable_variables, ref.trainable_variables, strict=True):
        diff = max(diff, assert_close(a.numpy(), b.numpy(), "weights", rtol=1e-5, atol=1e-6))
    return {"max_abs_diff": diff}


# -- Horovod's own compression= -------------------------------------------------------------------
def rank_tensor(rank: int, dtype=tf.float32) -> tf.Tensor:
    rng = np.random.default_rng(50 + rank)
    return tf.cast(tf.constant(rng.normal(size=(4, 6)).astype("float32")), dtype)


def mean_over_ranks(fn) -> np.ndarray:
    return np.mean([np.asarray(fn(rank_tensor(p)), np.float64) for p in range(SIZE)], axis=0)


def check_compression_classes() -> dict:
    t = rank_tensor(RANK)
    # FP16: halves the bytes, averages the rounded values (summed in float16 by Horovod).
    fp16 = th.FP16Compression()
    wire, _ = fp16.compress(t)
    got = hvd.allreduce(t, op=hvd.Average, compression=fp16)
    assert wire.dtype == tf.float16 and got.dtype == tf.float32
    assert_close(got, mean_over_ranks(lambda v: tf.cast(v, tf.float16)), "fp16", 1e-3, 1e-3)

    # BF16: rounds to bfloat16, moves float32; exact mean of the rounded values.
    bf16 = th.BF16Compression()
    wire, _ = bf16.compress(t)
    assert wire.dtype == tf.float32, wire.dtype
    got = hvd.allreduce(t, op=hvd.Average, compression=bf16)
    rounded = mean_over_ranks(lambda v: tf.cast(tf.cast(v, tf.bfloat16), tf.float32))
    assert_close(got, rounded, "bf16", 1e-7, 1e-7)
    # bfloat16 tensors: rejected by Horovod as they are, carried by BF16Compression.
    t16 = rank_tensor(RANK, tf.bfloat16)
    try:
        hvd.allreduce(t16, op=hvd.Average)
        raise AssertionError("Horovod accepted a bfloat16 all-reduce")
    except tf.errors.InvalidArgumentError:
        pass
    got16 = hvd.allreduce(t16, op=hvd.Average, compression=bf16)
    assert got16.dtype == tf.bfloat16, got16.dtype
    want16 = np.mean(
        [rank_tensor(p, tf.bfloat16).numpy().astype(np.float64) for p in range(SIZE)], 0
    )
    assert_close(tf.cast(got16, tf.float32), want16, "bf16 input", 1e-2, 1e-2)

    # RandomK: k shared indices, only k values travel; a new draw per call.
    randomk = th.RandomKCompression(ratio=0.25, seed=5)
    results = []
    codec = tfs.RandomK(0.25, seed=5)
    for _ in range(2):
        key = int(randomk.calls.numpy()) + 1
        got = hvd.allreduce(t, op=hvd.Average, compression=randomk)
        want = mean_over_ranks(lambda v, key=key: codec.decompress(*codec.compress(v, key, 0, 0)))
        assert_close(got, want, f"randomk call {key}")
        results.append(np.asarray(got) != 0)
    if np.array_equal(results[0], results[1]):
        raise AssertionError("RandomKCompression drew the same indices twice")
    payload, _ = randomk.compress(t)
    assert payload.shape == [6], payload.shape  # k = 25% of 24 entries

    # TopK: dense after sparsification (no bytes saved), mean of the ranks' top-k tensors.
    topk = th.TopKCompression(k=5)
    dense, _ = topk.compress(t)
    assert dense.shape == t.shape and int(tf.math.count_nonzero(dense)) == 5
    got = hvd.allreduce(t, op=hvd.Average, compression=topk)
    codec = tfs.TopK(k=5)
    assert_close(got, mean_over_ranks(lambda v: codec.decompress(*codec.compress(v))), "topk")

    # Horovod's own tape takes them.
    w = tf.Variable(tf.ones([4, 6]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * t)
    tape = hvd.DistributedGradientTape(tape, compression=th.FP16Compression())
    (g,) = tape.gradient(loss, [w])
    assert_close(g, mean_over_ranks(lambda v: v), "hvd.DistributedGradientTape fp16", 1e-3, 1e-3)

    # ... and in a tf.function, RandomK gives each gradient its own key, in order.
    shared = th.RandomKCompression(ratio=0.25, seed=9)
    w2 = tf.Variable(tf.ones([4, 6]))

    @tf.function
    def grads_in_graph(v):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * v) + tf.reduce_sum(w2 * 2.0 * v)
        return hvd.DistributedGradientTape(tape, compression=shared).gradient(loss, [w, w2])

    first = int(shared.calls.numpy()) + 1
    got = grads_in_graph(t)
    codec9 = tfs.RandomK(0.25, seed=9)
    for i, (grad, factor) in enumerate(zip(got, (1.0, 2.0), strict=True)):
        want = mean_over_ranks(
            lambda v, i=i, factor=factor: codec9.decompress(
                *codec9.compress(factor * v, first + i, 0, 0)
            )
        )
        assert_close(grad, want, f"hvd.DistributedGradientTape randomk grad {i}")
    assert int(shared.calls.numpy()) == first + 1
    return {}


# -- callbacks -------------------------------------------------------------------------------------
class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(logs))


def check_callbacks() -> dict:
    x, y = shard(seed=11)
    model = make_model(seed=RANK)  # different initial weights on each rank
    root = hvd.allgather_object([v.numpy() for v in model.variables])[0]
    opt = th.DistributedOptimizer(keras.optimizers.SGD(0.0, momentum=0.9), tfs.TopK(k=4))
    model.compile(optimizer=opt, loss=LOSS, jit_compile=False)
    raw, averaged = Recorder(), Recorder()
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[
            raw,
            th.MetricAverageCallback(),
            averaged,
            th.BroadcastGlobalVariablesCallback(),
        ],
    )
    # lr = 0: the weights are rank 0's initial weights on every rank.
    for v, want in zip(model.variables, root, strict=True):
        assert_close(v.numpy(), want, f"broadcast {v.path}", 0, 0)
    # Residuals are per rank (not broadcast): the shards differ, so they do.
    mine = opt.residuals[0].numpy()
    other = hvd.allgather_object(mine)[1 - RANK]
    if np.allclose(mine, other):
        raise AssertionError("residuals are equal on both ranks")
    losses = hvd.allgather_object(raw.logs[0]["loss"])
    if abs(losses[0] - losses[1]) < 1e-6:
        raise AssertionError(f"the ranks' raw losses should differ: {losses}")
    assert_close(averaged.logs[0]["loss"], np.mean(losses), "averaged loss", 1e-9, 1e-9)

    # broadcast_variables on Keras variables directly.
    keras_vars = [keras.Variable(np.full((3,), float(RANK)))]
    th.broadcast_variables(keras_vars, root_rank=1)
    assert_close(keras_vars[0].numpy(), np.ones(3), "broadcast_variables root 1", 0, 0)
    return {"raw_losses": losses, "averaged_loss": averaged.logs[0]["loss"]}


def check_probe_link(tmp: str) -> dict:
    """The link measured through the real all-reduce: the same numbers on every rank, and
    ``python -m tf_sparsify probe-link --out`` writes them on rank 0."""
    from tf_sparsify.__main__ import probe_link
    from tf_sparsify.core.link_probe import measure_link
    from tf_sparsify.horovod.collective import HorovodCollective
    from tf_sparsify.step_model.link_fit import LinkMeasurement

    measured = measure_link(HorovodCollective(), repeats=2)
    out = Path(tmp) / "link.json"
    assert probe_link(str(out), repeats=2) == 0
    written = LinkMeasurement.from_json(out.read_text()) if RANK == 0 else None
    assert written is None or written.workers == 2
    return {"seconds": list(measured.seconds), "bandwidth": measured.link().bandwidth}


def check_auto() -> dict:
    """``Auto`` under Horovod's Keras optimizer: the link and the codec costs measured through
    Horovod, the same decisions on every rank (a rank that chose otherwise would fail the plan
    check by name), and equal weights at the end."""
    x, y = shard(seed=13, n=96)
    model = make_model()
    opt = th.DistributedOptimizer(keras.optimizers.SGD(0.1), tfs.Auto())
    model.compile(optimizer=opt, loss=LOSS, jit_compile=False)
    auto = tfs.AutoCompression(interval=2)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[auto])
    weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    if not np.array_equal(*hvd.allgather_object(weights)):
        raise AssertionError("the ranks' weights differ")
    return {
        "decisions": [list(d.settings) for d in auto.decisions],
        "measured": [d.measured for d in auto.decisions],
        "link_workers": auto.link.workers,
    }


def main() -> None:
    checks = Checks()
    for name in CONFIGS:
        checks.run(f"update_{name}", lambda name=name: check_config(name))
    checks.run("update_powersgd", check_powersgd)
    checks.run("late_buckets", check_late_buckets)
    with tempfile.TemporaryDirectory() as tmp:
        checks.run("exchange_checkpoint", lambda: check_exchange_checkpoint(tmp))
        checks.run("probe_link", lambda: check_probe_link(tmp))
    checks.run("auto", check_auto)
    checks.run("tape_momentum_equals_optimizer", check_tape_momentum_equals_optimizer)
    checks.run("sparse_sgd_equals_dense", check_sparse_sgd_equals_dense)
    checks.run("identity_equals_horovod_average", check_identity_equals_horovod)
    checks.run("compression_classes", check_compression_classes)
    checks.run("callbacks", check_callbacks)
    checks.exit()


if __name__ == "__main__":
    main()
