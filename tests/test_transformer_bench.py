"""The benchmarks' transformer and its synthetic language (``benchmarks/network``).

In-process and small: the tiny transformer's shape and its one sparse gradient, the language's
chain, and the accuracy task learning it. The benchmark runs themselves are in
``test_network_bench.py``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks.network.language import MarkovLanguage
from benchmarks.network.models import TRANSFORMERS, language, make_model, synthetic_batch
from benchmarks.network.tasks import TASKS


def _sizes(model: keras.Model) -> dict[str, int]:
    """Parameters by part: token_embedding, blocks, final_norm, output."""
    sizes: dict[str, int] = {}
    for weight in model.trainable_weights:
        part = weight.path.split("/")[0]
        part = "blocks" if part.startswith("block") else part
        sizes[part] = sizes.get(part, 0) + int(np.prod(weight.shape))
    return sizes


def test_the_transformers_have_the_documented_sizes():
    tiny = make_model("transformer_tiny", 0, seed=0)
    assert _sizes(tiny) == {"token_embedding": 8192, "blocks": 17088, "final_norm": 64} | {
        "output": 8448
    }
    full = make_model("transformer", 0, seed=0)
    assert _sizes(full) == {
        "token_embedding": 16_384_000,
        "blocks": 6 * 3_152_384,
        "final_norm": 1_024,
        "output": 16_416_000,
    }
    assert full.count_params() == 51_715_328 and len(full.trainable_weights) == 101
    assert full.output_shape == (None, 128, 32000)


def test_only_the_embedding_gradient_is_sparse_and_it_holds_the_batch_rows():
    model = make_model("transformer_tiny", 0, seed=0)
    x, y = synthetic_batch("transformer_tiny", 0, batch=4, seed=1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True))
    grads = dict(
        zip(
            (w.path for w in model.trainable_weights),
            tape.gradient(value, model.trainable_weights),
            strict=True,
        )
    )
    sparse = {path for path, g in grads.items() if isinstance(g, tf.IndexedSlices)}
    assert sparse == {"token_embedding/embeddings"}
    rows = grads["token_embedding/embeddings"].indices.numpy()
    assert set(rows) == set(x.ravel())
    assert all(isinstance(g, tf.Tensor) for path, g in grads.items() if path not in sparse)


def test_the_language_walks_its_chain():
    chain = MarkovLanguage(vocab=50, length=6, successors=3, seed=4)
    tokens, targets = chain.batch(5, seed=(1, 0, 2))
    assert tokens.shape == targets.shape == (5, 6) and tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])  # targets: the next tokens
    for current, following in zip(tokens.ravel(), targets.ravel(), strict=True):
        assert following in chain.next_tokens[current]
    again = MarkovLanguage(vocab=50, length=6, successors=3, seed=4).batch(5, seed=(1, 0, 2))
    np.testing.assert_array_equal(again[0], tokens)
    other = chain.batch(5, seed=(1, 0, 3))[0]
    assert not np.array_equal(other, tokens)
    assert chain.loss_bound == pytest.approx(np.log(3))
    # the benchmark's transformers read their own vocabulary and length
    shape = TRANSFORMERS["transformer"]
    full = language("transformer")
    assert (full.vocab, full.length) == (shape.vocab, shape.length)


@pytest.mark.parametrize(
    ("argument", "value", "bound"),
    [("vocab", 0, 1), ("length", 0, 1), ("successors", 0, 1), ("zipf", -1.0, 0)],
)
def test_bad_language_arguments_are_named(argument, value, bound):
    kwargs = {"vocab": 10, "length": 4, argument: value}
    with pytest.raises(ValueError, match=f"^{argument} must be >= {bound}, got {value}$"):
        MarkovLanguage(**kwargs)


@pytest.mark.example
def test_the_tiny_transformer_learns_the_language():
    """One epoch (10 steps) of the accuracy task's own batches, model and optimizer, on one
    rank: the held-out loss falls from about log(vocab) by more than a nat."""
    task = TASKS["transformer_tiny"]
    model = task.model()
    model.compile(
        task.optimizer(task.lr),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    evaluation = task.evaluation()
    before = task.score(model, evaluation)
    assert before == pytest.approx(np.log(TRANSFORMERS["transformer_tiny"].vocab), abs=0.5)
    for x, y in task.epoch(rank=0, size=1, epoch=1, batch=task.batch):
        model.train_on_batch(x, y)
    after = task.score(model, evaluation)
    assert after < before - 1.0
    assert not task.reached(before, task.target) and task.reached(before, before + 1.0)
