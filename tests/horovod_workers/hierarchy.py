# ruff: noqa: E402  (Horovod reads HOROVOD_DYNAMIC_PROCESS_SETS at hvd.init, in common)
"""The hierarchical exchange under ``horovodrun -np 4`` as 2 "nodes" of 2 ranks.

``common`` calls ``hvd.init()``; with ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` set before it,
``tf_sparsify.horovod.init`` can add the process sets afterwards. Every rank knows every
rank's gradients (seeded by rank and step), so each computes the expected update itself: node
sums, shards, the compressor called directly on each shard with its residual, the mean over
all ranks.
"""

from __future__ import annotations

import os
import time

os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"

import keras
import numpy as np
import tensorflow as tf
from common import Checks, assert_close, hvd, train_step

import tf_sparsify as tfs
import tf_sparsify.horovod as th

SIZE, RANK = hvd.size(), hvd.rank()
L = 2  # ranks per node
NODE, LOCAL = divmod(RANK, L)
SHAPES = [(6, 5), (5,), (5, 3), (3,)]  # shards of 15, 3, 8 and 2 entries (two padded)
STEPS = 3
MAX_SECONDS = 30


def grads_of(rank: int, step: int, shapes=SHAPES, dtype="float32") -> list[tf.Tensor]:
    rng = np.random.default_rng(1000 + 100 * rank + step)
    return [tf.constant(rng.normal(size=s).astype(dtype)) for s in shapes]


def shard_size(shape, ranks_per_node: int = L) -> int:
    return -(-int(np.prod(shape)) // ranks_per_node)


def node_shards(step: int, node: int, shapes=SHAPES, dtype="float32") -> list[np.ndarray]:
    """Per variable, the node's sum flattened, zero-padded and split: ``[L, m]``."""
    ranks = range(node * L, node * L + L)
    sums = []
    for i, shape in enumerate(shapes):
        flat = sum(grads_of(p, step, shapes, dtype)[i].numpy().ravel() for p in ranks)
        m = shard_size(shape)
        sums.append(np.pad(flat, (0, L * m - flat.size)).reshape(L, m))
    return sums


def reference(codec, min_size: int, steps: int, shapes=SHAPES, dtype="float32"):
    """Updates per step, and each (node, local rank)'s shard residuals at the end."""
    nodes = SIZE // L
    residuals = {
        (c, j): [np.zeros(shard_size(s), dtype) for s in shapes]
        for c in range(nodes)
        for j in range(L)
    }
    updates = []
    for step in range(steps):
        sums = [node_shards(step, c, shapes, dtype) for c in range(nodes)]
        step_updates = []
        for i, shape in enumerate(shapes):
            lanes = []
            for j in range(L):
                total = np.zeros(shard_size(shape), np.float64)
                for c in range(nodes):
                    x = tf.constant(sums[c][i][j])
                    if shard_size(shape) < min_size:  # travels dense, without memory
                        total += x.numpy()
                        continue
                    acc = x + residuals[c, j][i]
                    payload, ctx = codec.compress(acc, step, i, c)  # replica id: node index
                    sent = codec.decompress(payload, ctx)
                    residuals[c, j][i] = (acc - sent).numpy()
                    total += sent.numpy()
                lanes.append(total / SIZE)
            flat = np.concatenate(lanes)[: int(np.prod(shape))]
            step_updates.append(flat.reshape(shape))
        updates.append(step_updates)
    return updates, residuals


def within_bytes_per_step(ranks_per_node: int = L, shapes=SHAPES, itemsize: int = 4) -> int:
    """Reduce-scatter of the padded gradient plus all-gather of one shard, per variable."""
    return sum((ranks_per_node + 1) * shard_size(s, ranks_per_node) * itemsize for s in shapes)


# -- checks ---------------------------------------------------------------------------------------
def expect_value_error(words: str, run) -> str:
    try:
        run()
    except ValueError as error:
        if words not in str(error):
            raise AssertionError(f"ValueError without {words!r}: {error}") from error
        return str(error)[:300]
    raise AssertionError(f"no ValueError ({words})")


def check_bad_input() -> dict:
    """Local ValueErrors naming ranks_per_node, before anything travels."""
    variables = [keras.Variable(np.zeros(s, "float32")) for s in SHAPES]
    sgd = keras.optimizers.SGD(1.0)
    messages = [
        expect_value_error("must divide the number of ranks (4)", lambda: th.init(3)),
        expect_value_error("ranks_per_node", lambda: th.init(0)),
        expect_value_error("ranks_per_node", lambda: th.init(-2)),
        expect_value_error("ranks_per_node", lambda: th.init(1.5)),
        expect_value_error("ranks_per_node", lambda: th.init(True)),
        expect_value_error(
            "ranks_per_node", lambda: th.DistributedOptimizer(sgd, tfs.TopK(k=2), ranks_per_node=0)
        ),
        expect_value_error(
            "ranks_per_node", lambda: th.GradientExchange(tfs.TopK(k=2), ranks_per_node=-1)
        ),
        expect_value_error(
            "must divide the number of ranks",
            lambda: th.GradientExchange(tfs.TopK(k=2), ranks_per_node=3).updates(
                grads_of(RANK, 0), variables
            ),
        ),
        expect_value_error(  # not registered yet: says how to register it
            "tf_sparsify.horovod.init(ranks_per_node=2)",
            lambda: th.GradientExchange(tfs.TopK(k=2), ranks_per_node=2).updates(
                grads_of(RANK, 0), variables
            ),
        ),
        expect_value_error(
            "local_clipnorm",
            lambda: th.GradientExchange(tfs.TopK(k=2), local_clipnorm=1.0, ranks_per_node=2),
        ),
        expect_value_error(
            "compresses each tensor by its shape",
            lambda: th.GradientExchange(tfs.PowerSGD(2), ranks_per_node=2),
        ),
    ]
    return {"messages": messages[:3]}


def check_init_mismatch() -> dict:
    """Ranks asking for different layouts all get a ValueError naming ranks_per_node."""
    start = time.perf_counter()
    message = expect_value_error("same `ranks_per_node`", lambda: th.init(2 if RANK < 2 else 4))
    if "[2, 2, 4, 4]" not in message:
        raise AssertionError(f"the message does not list the ranks' values: {message}")
    return {"message": message, "error_seconds": round(time.perf_counter() - start, 2)}


def check_init() -> dict:
    topology = th.init(ranks_per_node=L)
    if topology.nodes != ((0, 1), (2, 3)) or (topology.node, topology.local) != (NODE, LOCAL):
        raise AssertionError(f"topology {topology}")
    if topology.node_set.ranks != list(topology.nodes[NODE]):
        raise AssertionError(f"node set {topology.node_set}")
    if topology.lane_set.ranks != [LOCAL, L + LOCAL]:
        raise AssertionError(f"lane set {topology.lane_set}")
    if th.init(ranks_per_node=L) is not topology:
        raise AssertionError("a second init made a new topology")
    return {}


def check_update_topk_ef() -> dict:
    """Optimizer (tf.function) and exchange (eager): updates and shard residuals equal the
    hand computation for 3 steps; bytes across nodes == bytes_sent == wire bytes; bytes within
    nodes == the reduce-scatter and all-gather of every variable."""
    min_size = 4  # shards of 3 and 2 entries travel dense
    expected, residuals = reference(tfs.TopK(k=3), min_size, STEPS)
    variables = [keras.Variable(np.zeros(s, "float32")) for s in SHAPES]
    opt = th.DistributedOptimizer(
        keras.optimizers.SGD(1.0), tfs.TopK(k=3), ranks_per_node=L, min_size=min_size
    )
    exchange = th.GradientExchange(tfs.TopK(k=3), min_size=min_size, ranks_per_node=L)
    apply = train_step(opt, variables)

    tol = {"rtol": 1e-5, "atol": 1e-6}
    for step in range(STEPS):
        before = [v.numpy() for v in variables]
        apply(grads_of(RANK, step))
        got = [b - v.numpy() for b, v in zip(before, variables, strict=True)]
        tape = exchange.updates(grads_of(RANK, step), variables)
        for i in range(len(SHAPES)):
            assert_close(got[i], expected[step][i], f"optimizer update {i} step {step}", **tol)
            assert_close(tape[i], expected[step][i], f"exchange update {i} step {step}", **tol)
    for i in range(len(SHAPES)):
        for name, buffers in (("optimizer", opt.residuals), ("exchange", exchange.residuals)):
            if (buffers[i] is None) != (shard_size(SHAPES[i]) < min_size):
                raise AssertionError(f"{name} residual {i}: wrong presence")
            if buffers[i] is not None:
                want = residuals[NODE, LOCAL][i]
                assert_close(np.ravel(buffers[i].numpy()), want, f"{name} residual {i}", **tol)
    wire = opt.wire_bytes_per_step
    within = within_bytes_per_step()
    for name, front in (("optimizer", opt), ("exchange", exchange)):
        across = int(front.bytes_across_nodes.numpy())
        if not across == int(front.bytes_sent.numpy()) == STEPS * wire:
            raise AssertionError(f"{name}: across {across}, sent {front.bytes_sent.numpy()}")
        if int(front.bytes_within_nodes.numpy()) != STEPS * within:
            raise AssertionError(f"{name}: within {front.bytes_within_nodes.numpy()}")
    return {"wire_bytes_per_step": wire, "within_bytes_per_step": within}


def check_conservation() -> dict:
    """float64: P * sum of updates + every shard's residual (reassembled per node) == sum of
    all gradients; the padding's residuals stay zero; every rank applies the same update."""
    shapes, steps = [(7, 3), (5,)], 4
    variables = [tf.Variable(tf.zeros(s, tf.float64)) for s in shapes]
    exchange = th.GradientExchange(tfs.TopK(k=2), ranks_per_node=L)
    applied = [np.zeros(s) for s in shapes]
    for step in range(steps):
        updates = exchange.updates(grads_of(RANK, step, shapes, "float64"), variables)
        applied = [a + u.numpy() for a, u in zip(applied, updates, strict=True)]
    everyone = hvd.allgather_object(([a for a in applied], [r.numpy() for r in exchange.residuals]))
    for p, (theirs, _) in enumerate(everyone):
        for i, (a, b) in enumerate(zip(applied, theirs, strict=True)):
            assert_close(a, b, f"rank {p} applied update {i}", 0, 0)
    worst = 0.0
    for i, shape in enumerate(shapes):
        n = int(np.prod(shape))
        kept = np.zeros(n)
        for c in range(SIZE // L):
            node = np.concatenate([np.ravel(everyone[c * L + j][1][i]) for j in range(L)])
            if np.any(node[n:]):
                raise AssertionError(f"variable {i}: the padding's residual is not zero")
            kept += node[:n]
        sent = sum(
            grads_of(p, t, shapes, "float64")[i].numpy().ravel()
            for p in range(SIZE)
            for t in range(steps)
        )
        got = SIZE * applied[i].ravel() + kept
        worst = max(worst, assert_close(got, sent, f"conservation {i}", 1e-12, 1e-12))
    return {"max_abs_error": worst}


def check_identity_equals_horovod() -> dict:
    """Identity across nodes == plain Horovod averaging (hvd.allreduce) for 2 nodes of 2, 4
    nodes of 1 (nothing summed inside nodes) and 1 node of 4 (nothing crosses nodes), with
    the bytes counted where they go."""
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    if th.init(1).node_set is not None or th.init(4).lane_set is not None:
        raise AssertionError("a group of one rank got a process set")
    out = {}
    for per_node in (L, 1, 4):
        exchange = th.GradientExchange(ranks_per_node=per_node)
        for step in range(2):
            grads = grads_of(RANK, step)
            got = exchange.updates(grads, variables)
            for i, g in enumerate(grads):
                want = hvd.allreduce(g, op=hvd.Average)
                assert_close(got[i], want, f"ranks_per_node={per_node} {i} step {step}", 1e-6, 1e-6)
        across, within = exchange.bytes_across_nodes.numpy(), exchange.bytes_within_nodes.numpy()
        out[f"across_within_{per_node}"] = [int(across), int(within)]
    expected = {
        f"across_within_{per_node}": [
            0 if per_node == SIZE else 2 * sum(4 * shard_size(s, per_node) for s in SHAPES),
            0 if per_node == 1 else 2 * within_bytes_per_step(per_node),
        ]
        for per_node in (L, 1, 4)
    }
    if out != expected:
        raise AssertionError(f"bytes {out} != {expected}")
    return out


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model_steps(optimizer, steps: int = 3) -> keras.Model:
    """A few eager steps of the test MLP (8-16-3) on this rank's data."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
    )
    rng = np.random.default_rng(7 + RANK)
    for _ in range(steps):
        x, y = rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 3, 16)
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
    return model


def expect_mismatch(run) -> dict:
    start = time.perf_counter()
    try:
        run()
    except tf.errors.InvalidArgumentError as error:
        seconds = time.perf_counter() - start
        message = str(error)
        if "differ in their ranks_per_node" not in message or f"rank {RANK} of 4" not in message:
            raise AssertionError(f"error does not name ranks_per_node: {message[:1500]}") from error
        if seconds > MAX_SECONDS:
            raise AssertionError(f"the error took {seconds:.1f} s") from error
        line = next(s for s in message.splitlines() if "configured differently" in s)
        return {"message": line.strip()[:300], "error_seconds": round(seconds, 2)}
    raise AssertionError("no error although the ranks differ")


def check_mismatch_optimizer() -> dict:
    """Node 0 hierarchical, node 1 flat: every rank fails at the first step."""
    per_node = L if NODE == 0 else None
    opt = th.DistributedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=4), ranks_per_node=per_node)
    return expect_mismatch(lambda: model_steps(opt))


def check_mismatch_exchange() -> dict:
    """Local rank 0 with 2 ranks per node, local rank 1 with one node of 4."""
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    exchange = th.GradientExchange(tfs.TopK(k=2), ranks_per_node=L if LOCAL == 0 else 4)
    return expect_mismatch(lambda: exchange.updates(grads_of(RANK, 0), variables))


def check_model_bytes() -> dict:
    """After the mismatches a matching run trains (every rank ends with the same weights);
    bytes per step and rank on the test MLP with TopK 10% + EF: across and within nodes,
    against the flat exchange's plan (whose bytes exact.py pins)."""
    hier = th.DistributedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.1), ranks_per_node=L)
    model = model_steps(hier)
    weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    if any(not np.array_equal(w, weights) for w in hvd.allgather_object(weights)):
        raise AssertionError("the ranks' weights differ")
    flat = th.DistributedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.1))
    flat.build(model.trainable_variables)
    steps = int(hier.exchange_steps.numpy())
    return {
        "dense_bytes_per_step": flat.dense_bytes_per_step,
        "flat_bytes_per_step": flat.wire_bytes_per_step,
        "across_bytes_per_step": int(hier.bytes_across_nodes.numpy()) / steps,
        "within_bytes_per_step": int(hier.bytes_within_nodes.numpy()) / steps,
    }


def main() -> None:
    checks = Checks()
    checks.run("bad_input", check_bad_input)
    checks.run("init_mismatch", check_init_mismatch)
    checks.run("init", check_init)
    checks.run("update_topk_ef", check_update_topk_ef)
    checks.run("conservation", check_conservation)
    checks.run("identity_equals_horovod", check_identity_equals_horovod)
    checks.run("mismatch_optimizer", check_mismatch_optimizer)
    checks.run("mismatch_exchange", check_mismatch_exchange)
    checks.run("model_bytes", check_model_bytes)
    hvd.allreduce(tf.constant(0.0), name="tf_sparsify_hierarchy_done")  # no rank leaves early
    checks.exit()


if __name__ == "__main__":
    main()
