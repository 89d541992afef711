"""The small embedding model the sparse-gradient tests train (its embedding's gradient is a
``tf.IndexedSlices``), with fixed data; shared by ``tests/test_sparse_gradients.py``,
``tests/test_optimizer.py`` and the Horovod worker ``tests/horovod_workers/sparse_rows.py``."""

from __future__ import annotations

import keras
import numpy as np

VOCAB, LENGTH = 50, 4
#: 32 sequences of 4 tokens (duplicates within a batch; some of the 50 tokens never appear)
TOKENS = np.random.default_rng(11).integers(0, VOCAB, size=(32, LENGTH))
TARGETS = np.random.default_rng(12).normal(size=(32, 2)).astype("float32")


def embedding_model(vocab: int = VOCAB, width: int = 8, length: int = LENGTH) -> keras.Model:
    """Token ids ``[batch, length]`` -> an ``Embedding(vocab, width)``, averaged over the
    sequence, and a dense head of 2 outputs; weights seeded (0), the same in every process."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((length,), dtype="int32"),
            keras.layers.Embedding(vocab, width),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ]
    )
