"""What the accuracy mode trains: one task per model, with its data, its score and its target.

A task says how to build its model and inner optimizer, which batches a rank trains on in an
epoch, what it is scored on after each epoch (untimed) and which score counts as reached.
TensorFlow and Keras are imported inside the methods: the launcher reads the names, metrics
and defaults from here and stays light.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from benchmarks.network.models import TRANSFORMERS, language, make_model, mlp

if TYPE_CHECKING:
    import keras

SEED = 0
Batch = tuple[np.ndarray, np.ndarray]


class Task(abc.ABC):
    """One model on one learning problem, trained by every rank on its own batches."""

    #: the plot's title, before the ranks and rate
    title: str
    #: what :meth:`score` returns, for tables and plots
    metric: str
    #: whether a higher score is better (accuracy) or a lower one (loss)
    higher_is_better: bool
    #: defaults for the command line: the score to reach, epochs, batch per rank, learning rate
    target: float
    epochs: int
    batch: int
    lr: float

    def reached(self, score: float, target: float) -> bool:
        """Whether ``score`` is at least as good as ``target``."""
        return score >= target if self.higher_is_better else score <= target

    @abc.abstractmethod
    def model(self) -> keras.Model:
        """The model, the same initial weights in every process."""

    @abc.abstractmethod
    def optimizer(self, lr: float) -> keras.Optimizer:
        """The inner optimizer the compressors wrap."""

    @abc.abstractmethod
    def epoch(self, rank: int, size: int, epoch: int, batch: int) -> Iterator[Batch]:
        """Rank ``rank``'s training batches of epoch ``epoch`` (from 1) of ``size`` ranks."""

    @abc.abstractmethod
    def evaluation(self) -> Batch:
        """The data every score is taken on (the same on every rank)."""

    @abc.abstractmethod
    def score(self, model: keras.Model, data: Batch) -> float:
        """``model``'s score on ``data``."""


class DigitsMLP(Task):
    """scikit-learn's bundled digits (no download), an equal shard of the training split per
    rank, a 64->1024->1024->10 MLP with plain SGD (with momentum 0.9 TopK + EF oscillated
    here); scored by accuracy on the whole test split."""

    title = "digits, wide MLP"
    metric = "test accuracy"
    higher_is_better = True
    target, epochs, batch, lr = 0.95, 20, 32, 0.1

    @staticmethod
    @cache
    def split() -> tuple[np.ndarray, ...]:
        """``(x_train, y_train, x_test, y_test)``, 25% stratified for the test."""
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype("float32")
        return tuple(train_test_split(x, y, test_size=0.25, random_state=0, stratify=y))

    def model(self) -> keras.Model:
        import keras

        keras.utils.set_random_seed(SEED)
        return mlp(64, (1024, 1024))

    def optimizer(self, lr: float) -> keras.Optimizer:
        import keras

        return keras.optimizers.SGD(lr)

    def epoch(self, rank: int, size: int, epoch: int, batch: int) -> Iterator[Batch]:
        """A shuffled pass over this rank's shard (all shards the same length)."""
        x_train, _, y_train, _ = self.split()
        per_rank = len(x_train) // size
        shard = np.random.default_rng(SEED).permutation(len(x_train))[rank * per_rank :]
        shard = shard[:per_rank]
        order = shard[np.random.default_rng(epoch * 1000 + rank).permutation(per_rank)]
        for first in range(0, per_rank - batch + 1, batch):
            rows = order[first : first + batch]
            yield x_train[rows], y_train[rows]

    def evaluation(self) -> Batch:
        _, x_test, _, y_test = self.split()
        return x_test, y_test

    def score(self, model: keras.Model, data: Batch) -> float:
        x, y = data
        return float(np.mean(np.argmax(model.predict_on_batch(x), axis=1) == y))


class NextToken(Task):
    """A transformer of :data:`~benchmarks.network.models.TRANSFORMERS` predicting the next
    token of its synthetic language (:func:`~benchmarks.network.models.language`, a sparse
    Markov chain: loss at most log 4 = 1.39 nats per token is achievable, log(vocab) is what
    knowing nothing costs), with Adam. An epoch is ``steps`` fresh batches per rank (seeded by
    epoch, rank and step); scored by the mean cross-entropy (nats per token) on ``evaluated``
    held-out sequences."""

    metric = "eval loss (nats/token)"
    higher_is_better = False

    def __init__(
        self,
        model_name: str,
        target: float,
        epochs: int,
        steps: int,
        batch: int,
        lr: float,
        evaluated: int,
    ):
        self.model_name, self.steps, self.evaluated = model_name, steps, evaluated
        self.target, self.epochs, self.batch, self.lr = target, epochs, batch, lr
        shape = TRANSFORMERS[model_name]
        self.title = (
            f"next token, {model_name} ({shape.layers} layers, d_model {shape.d_model}, "
            f"vocab {shape.vocab}, length {shape.length})"
        )

    def model(self) -> keras.Model:
        return make_model(self.model_name, 0, SEED)

    def optimizer(self, lr: float) -> keras.Optimizer:
        import keras

        return keras.optimizers.Adam(lr)

    def epoch(self, rank: int, size: int, epoch: int, batch: int) -> Iterator[Batch]:
        for step in range(self.steps):
            yield language(self.model_name).batch(batch, seed=(epoch, rank, step))

    def evaluation(self) -> Batch:
        return language(self.model_name).batch(self.evaluated, seed=(0, 0, 0))  # epochs >= 1

    def score(self, model: keras.Model, data: Batch) -> float:
        import keras

        x, y = data
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        chunk = 8  # sequences per forward pass: bounds the logits' memory
        total = sum(
            float(loss(y[i : i + chunk], model(x[i : i + chunk], training=False)))
            for i in range(0, len(x), chunk)
        )
        return total / y.size


#: The accuracy mode's tasks by ``--models`` name. The transformer's language (8,416 of its
#: 32,000 tokens in use) has an entropy rate of 1.35 nats per token, the best loss there is;
#: knowing only how frequent each token is gives 5.70 (the entropy of the chain's stationary
#: distribution). The target, 4 nats per token, takes context to reach. One dense run with
#: Adam(1e-3) and 8 sequences per step (2 ranks' batch) on one core went 10.39 -> 5.92, 5.50,
#: 5.00, 4.67, 4.04, 3.55, 3.21 after 10, 20, ..., 70 steps: dense needs about a fifth of the
#: 300 steps.
TASKS: dict[str, Task] = {
    "digits": DigitsMLP(),
    "transformer": NextToken(
        "transformer", target=4.0, epochs=12, steps=25, batch=4, lr=1e-3, evaluated=16
    ),
    "transformer_tiny": NextToken(
        "transformer_tiny", target=3.0, epochs=4, steps=10, batch=8, lr=1e-2, evaluated=16
    ),
}
