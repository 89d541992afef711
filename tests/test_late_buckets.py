"""One-step-late buckets (``late_buckets``, :mod:`tf_sparsify.core.late`): the real delay
equals the simulated one, conserves the gradient, is checkpointed (per replica: a fresh
process restored from a checkpoint written inside ``fit`` continues exactly), is applied when
``fit`` ends, and its collectives do not depend on the step's gradients in the traced graph."""

from __future__ import annotations

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tests.conftest import run_python
from tests.embedding_model import TARGETS, TOKENS, embedding_model
from tf_sparsify.collectives import LocalCollective
from tf_sparsify.distribute import DelayedGradients, ServerOptimizer
from tf_sparsify.testing import numpy_reference as npref

RNG = np.random.default_rng(3)
X = RNG.standard_normal((64, 8)).astype(np.float32)
Y = RNG.standard_normal((64, 2)).astype(np.float32)
#: four steps of fixed gradients for a [6, 4] kernel and a [4] bias
GRADS = [
    [RNG.standard_normal((6, 4)).astype(np.float32), RNG.standard_normal(4).astype(np.float32)]
    for _ in range(4)
]


def mlp() -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(6), keras.layers.Dense(2)])


def fit_weights(strategy, make_optimizer) -> tuple[list[list[np.ndarray]], keras.Model]:
    """Every step's weights over two epochs of ``fit`` (4 steps each), and the model."""
    with strategy.scope():
        model = mlp()
        model.compile(make_optimizer(), "mse", jit_compile=False)
    steps = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: steps.append([w.numpy() for w in model.weights])
    )
    model.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[record])
    return steps, model


@pytest.mark.parametrize(
    "compressor",
    [lambda: tfs.TopK(ratio=0.3), lambda: tfs.QSGD(levels=4, seed=2)],
    ids=["topk", "qsgd"],
)
def test_every_bucket_late_equals_delayed_gradients_of_one_step(mirrored2, compressor):
    late, late_model = fit_weights(
        mirrored2,
        lambda: tfs.SparsifiedOptimizer(
            keras.optimizers.SGD(0.1), compressor(), late_buckets="all"
        ),
    )
    simulated, _ = fit_weights(
        mirrored2,
        lambda: ServerOptimizer(keras.optimizers.SGD(0.1), compressor(), DelayedGradients(1)),
    )
    assert len(late) == len(simulated) == 8
    for step, (a, b) in enumerate(zip(late, simulated, strict=True)):
        for u, v in zip(a, b, strict=True):
            np.testing.assert_array_equal(u, v, err_msg=f"step {step}")
    # fit's end applied the last step's update, still in flight: one more step
    assert int(late_model.optimizer.iterations.numpy()) == 9
    assert any(
        not np.array_equal(u, v) for u, v in zip(late[-1], late_model.get_weights(), strict=True)
    )


def numpy_late_topk(k: int, lr: float, steps: list) -> tuple[list[np.ndarray], list, list]:
    """Weights, residuals and in-flight gradients of TopK with error feedback, every tensor
    one step late (the kernel's NumPy model; starts at zero weights)."""
    weights = [np.zeros_like(g) for g in steps[0]]
    residuals = [np.zeros_like(g) for g in steps[0]]
    in_flight = [np.zeros_like(g) for g in steps[0]]
    for grads in [*steps, [np.zeros_like(g) for g in steps[0]]]:  # the last: the flush
        for i, g in enumerate(grads):
            values, indices, residual = npref.topk_error_feedback(
                in_flight[i].view(np.uint32), residuals[i].view(np.uint32), k, "float32"
            )
            sent = np.zeros(g.size, np.float32)
            sent[indices] = values.view(np.float32)
            residuals[i] = residual.view(np.float32).reshape(g.shape)
            weights[i] = weights[i] - np.float32(lr) * sent.reshape(g.shape)
            in_flight[i] = g
    return weights, residuals, in_flight


def test_late_topk_matches_numpy_and_conserves_the_gradient():
    variables = [tf.Variable(tf.zeros([6, 4])), tf.Variable(tf.zeros([4]))]
    optimizer = tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.5), tfs.TopK(k=3), late_buckets="all"
    )
    for grads in GRADS:
        optimizer.apply([tf.constant(g) for g in grads], variables)
    optimizer.apply_in_flight()
    weights, residuals, in_flight = numpy_late_topk(3, 0.5, GRADS)
    for v, w in zip(variables, weights, strict=True):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-6, atol=1e-7)
    state = optimizer._state
    for buffer, expected in zip(state.residuals, residuals, strict=True):
        np.testing.assert_allclose(buffer.numpy(), expected, rtol=1e-6, atol=1e-7)
    for buffer, expected in zip(state.in_flight, in_flight, strict=True):
        np.testing.assert_array_equal(buffer.numpy(), expected)
    # conservation: applied updates + residual + in flight = every gradient, nothing lost
    for i, v in enumerate(variables):
        applied = -v.numpy() / 0.5
        total = sum(g[i] for g in GRADS)
        np.testing.assert_allclose(
            applied + state.residuals[i].numpy() + state.in_flight[i].numpy(), total, atol=1e-5
        )


def test_only_the_last_bucket_backprop_fills_waits_a_step():
    model = mlp()
    optimizer = tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.5), late_buckets="last", bucket_bytes=1
    )
    model.compile(optimizer, "mse", jit_compile=False)
    before = model.get_weights()
    model.train_on_batch(X[:16], Y[:16])
    after = model.get_weights()
    # one bucket per variable: the first layer's kernel is the last bucket backprop fills
    assert optimizer._state.late == [True, False, False, False]
    np.testing.assert_array_equal(after[0], before[0])  # its first update is in flight
    assert all(not np.array_equal(a, b) for a, b in zip(after[1:], before[1:], strict=True))


def embedding_step(late_buckets: str) -> tuple[list[np.ndarray], int]:
    """Weights and bytes sent after one ``train_on_batch`` of the embedding model, TopK 25%."""
    model = embedding_model()
    optimizer = tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.5), tfs.TopK(ratio=0.25), late_buckets=late_buckets
    )
    model.compile(optimizer, "mse", jit_compile=False)
    model.train_on_batch(TOKENS[:8], TARGETS[:8])
    return model.get_weights(), int(optimizer.bytes_sent.numpy())


def test_an_embeddings_rows_travel_now_as_rows():
    """A late variable whose gradient is ``IndexedSlices`` travels in the step, as rows (an
    in-flight buffer would hold it dense: TopK of the whole table): the first step updates the
    embedding as synchronous training does, the dense head not yet, and sends what it sends."""
    (embedding, *head), sent = embedding_step("all")
    (want_embedding, *want_head), want_sent = embedding_step("none")
    np.testing.assert_array_equal(embedding, want_embedding)
    initial = embedding_model().get_weights()[1:]
    for h, start, moved in zip(head, initial, want_head, strict=True):
        np.testing.assert_array_equal(h, start)
        assert np.any(moved != start)
    assert sent == want_sent


def test_restore_then_continue_equals_not_stopping(tmp_path):
    def make() -> tuple[list, tfs.SparsifiedOptimizer]:
        variables = [tf.Variable(tf.zeros([6, 4])), tf.Variable(tf.zeros([4]))]
        optimizer = tfs.SparsifiedOptimizer(
            keras.optimizers.Adam(0.1), tfs.TopK(k=5), late_buckets="all"
        )
        optimizer.build(variables)
        return variables, optimizer

    def steps(variables, optimizer, grads) -> None:
        for g in grads:
            optimizer.apply([tf.constant(t) for t in g], variables)

    variables, optimizer = make()
    steps(variables, optimizer, GRADS)
    optimizer.apply_in_flight()

    first, first_optimizer = make()
    steps(first, first_optimizer, GRADS[:2])
    path = tf.train.Checkpoint(variables=first, optimizer=first_optimizer).write(
        str(tmp_path / "ckpt")
    )
    assert np.any(first_optimizer.in_flight[0].numpy())
    second, second_optimizer = make()
    tf.train.Checkpoint(variables=second, optimizer=second_optimizer).read(path).assert_consumed()
    steps(second, second_optimizer, GRADS[2:])
    second_optimizer.apply_in_flight()
    for a, b in zip(variables, second, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def late_model(strategy) -> keras.Model:
    """The MLP in ``strategy``'s scope, TopK around SGD with momentum, ``late_buckets="last"``
    (the model is one bucket: every variable travels late), built."""
    with strategy.scope():
        model = mlp()
        optimizer = tfs.SparsifiedOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), tfs.TopK(ratio=0.3), late_buckets="last"
        )
        model.compile(optimizer, "mse", jit_compile=False)
        optimizer.build(model.trainable_variables)
    return model


class SaveMidFit(keras.callbacks.Callback):
    """Writes a checkpoint at the end of the first epoch, inside ``fit`` (whose end applies
    what is in flight), and keeps every replica's in-flight gradients then."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.in_flight: list[np.ndarray] = []

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            optimizer = self.model.optimizer
            tf.train.Checkpoint(model=self.model, optimizer=optimizer).write(self.path)
            self.in_flight = [
                np.stack([r.numpy() for r in v.value.values])  # a Keras variable's replicas
                for v in optimizer.in_flight
                if v is not None
            ]


def test_mirrored_in_flight_restored_in_a_fresh_process_continues_exactly(tmp_path, mirrored2):
    """MirroredStrategy on 2 CPU devices with late buckets: 2 epochs of ``fit`` straight equal
    its checkpoint written after the first epoch (inside ``fit``, a different non-zero gradient
    in flight on each replica) restored in a fresh process, which builds everything from the
    file and fits 1 more epoch: same weights bit for bit, same number of steps (4 + 4 + the one
    that applies what is in flight when ``fit`` ends). Each replica gets its own in-flight row
    back: dropped or swapped, the weights differ."""
    straight = late_model(mirrored2)
    save = SaveMidFit(str(tmp_path / "mid_fit"))
    straight.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[save])
    assert len(save.in_flight) == 4  # every variable was in flight at the save
    for rows in save.in_flight:
        assert rows.shape[0] == 2 and rows.any() and not np.array_equal(rows[0], rows[1])
    out = tmp_path / "resumed.npz"
    run_python(f"""
        import numpy as np
        import tensorflow as tf

        # imports tests/conftest.py: the 4 logical CPU devices of the test process
        from tests.test_late_buckets import X, Y, late_model

        model = late_model(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        checkpoint.read({save.path!r}).assert_consumed()
        model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        steps = model.optimizer.iterations.numpy()
        np.savez({str(out)!r}, steps, *[w.numpy() for w in model.weights])
    """)
    resumed = np.load(out)
    want = [np.asarray(straight.optimizer.iterations.numpy())] + straight.get_weights()
    assert int(want[0]) == 9 and len(resumed.files) == len(want)
    for name, expected in zip(resumed.files, want, strict=True):
        np.testing.assert_array_equal(resumed[name], expected, err_msg=name)


def test_a_second_flush_applies_nothing():
    variables = [tf.Variable(tf.zeros([6, 4])), tf.Variable(tf.zeros([4]))]
    optimizer = tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.5), tfs.TopK(k=24), late_buckets="all"
    )
    optimizer.apply([tf.constant(g) for g in GRADS[0]], variables)
    optimizer.apply_in_flight()
    once = [v.numpy() for v in variables]
    optimizer.apply_in_flight()
    for v, w in zip(variables, once, strict=True):
        np.testing.assert_array_equal(v.numpy(), w)


def test_fit_traces_what_it_applies_at_its_end_once_per_train_step(monkeypatch):
    """``fit`` applies what is in flight through a function traced at its first end, not at
    every end; again after Keras' step is retraced (its plan may have changed)."""
    traced = []
    apply_in_flight = tfs.SparsifiedOptimizer.apply_in_flight

    def counting(self):
        traced.append(self)
        apply_in_flight(self)

    monkeypatch.setattr(tfs.SparsifiedOptimizer, "apply_in_flight", counting)
    model = mlp()
    optimizer = tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.1), tfs.TopK(k=3), late_buckets="all"
    )
    model.compile(optimizer, "mse", jit_compile=False)
    ends = []
    for _ in range(3):
        model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        ends.append([w.numpy() for w in model.weights])
    assert traced == [optimizer]
    model.make_train_function(force=True)
    model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert traced == [optimizer, optimizer]
    assert not np.array_equal(ends[1][0], ends[2][0])  # the third fit (and its end) ran


def test_a_custom_loop_applies_what_is_in_flight_after_its_last_step():
    variables = [tf.Variable(tf.zeros([6, 4])), tf.Variable(tf.zeros([4]))]
    exchange = tfs.GradientExchange(tfs.TopK(k=3), late_buckets="all")
    optimizer = keras.optimizers.SGD(0.5)
    for grads in GRADS:
        optimizer.apply(exchange.updates([tf.constant(g) for g in grads], variables), variables)
    optimizer.apply(exchange.in_flight_updates(variables), variables)
    weights, _, _ = numpy_late_topk(3, 0.5, GRADS)
    for v, w in zip(variables, weights, strict=True):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-6, atol=1e-7)
    assert exchange.needs_state()
    assert tfs.GradientExchange(tfs.TopK(k=3)).in_flight_updates(variables) == [None, None]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"late_buckets": "first"}, "late_buckets='first'"),
        ({"late_buckets": True}, "late_buckets=True"),
        ({"late_buckets": "all", "local_clipnorm": 1.0}, "late_buckets='all'"),
    ],
)
def test_bad_late_buckets_are_named(kwargs, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=2), **kwargs)


def test_a_server_refuses_real_late_buckets():
    with pytest.raises(ValueError, match="late_buckets='last'"):
        ServerOptimizer(
            keras.optimizers.SGD(0.1), tfs.TopK(k=2), DelayedGradients(1), late_buckets="last"
        )


# -- the traced graph: what the late collectives depend on -----------------------------------
class CollectiveOps(LocalCollective):
    """One replica whose payloads pass through TensorFlow's collective op (a group of one),
    as under ``MultiWorkerMirroredStrategy``: ordered with the step's other stateful ops by
    TensorFlow's automatic control dependencies."""

    keys = itertools.count(1)

    def _reduce(self, t: tf.Tensor) -> tf.Tensor:
        carried = t if t.dtype.is_floating else tf.cast(t, tf.int64)  # the op's dtypes
        reduced = tf.raw_ops.CollectiveReduceV2(
            input=carried,
            group_size=tf.constant(1),
            group_key=tf.constant(1),
            instance_key=tf.constant(next(self.keys)),
            ordering_token=[],
            merge_op="Add",
            final_op="Id",
        )
        return tf.cast(reduced, t.dtype)

    def all_reduce_sum(self, tensors):
        return [self._reduce(t) for t in tensors]

    def all_gather(self, tensors):
        return [self._reduce(t)[None] for t in tensors]


def ancestors(op: tf.Operation) -> set[tf.Operation]:
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def collectives_on_the_gradient(late_buckets: str) -> list[bool]:
    """For each collective of a traced step (forward, backward, exchange), whether it depends
    on the step's gradients (through data or control edges)."""
    model = mlp()
    optimizer = tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.5), late_buckets=late_buckets, bucket_bytes=1
    )
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        grads = [tf.identity(g, name="step_gradient") for g in grads]
        optimizer.compression_step(grads, CollectiveOps())

    graph = step.get_concrete_function(tf.constant(X[:16]), tf.constant(Y[:16])).graph
    collectives = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    assert collectives
    return [
        any(a.name.split("/")[-1].startswith("step_gradient") for a in ancestors(op))
        for op in collectives
    ]


def test_late_collectives_do_not_depend_on_the_steps_gradients():
    assert all(collectives_on_the_gradient("none"))
    assert not any(collectives_on_the_gradient("all"))
    last = collectives_on_the_gradient("last")
    assert not all(last) and any(last)
