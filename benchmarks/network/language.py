"""A synthetic language that a transformer can learn: a fixed random sparse Markov chain.

Every token of the vocabulary has ``successors`` next tokens, drawn once (with a seed) from a
Zipf-like popularity over a random permutation of the vocabulary, and the next token is one of
them, uniformly. Frequent tokens are few (as in text: a batch touches a small share of the
embedding's rows) and each token's next token is one of at most ``successors`` choices, so the
best achievable loss is at most ``log(successors)`` nats per token (duplicates among a token's
successors only lower it), far below ``log(vocab)`` for a model that knows nothing. NumPy only.
"""

from __future__ import annotations

import numpy as np


class MarkovLanguage:
    """Sequences of ``length`` tokens and their next tokens from one seeded chain over ``vocab``.

    ``zipf``: the exponent of the popularity ``rank ** -zipf`` that successors and first tokens
    are drawn from (0: uniform; 1.0 keeps about a quarter of a 32k vocabulary in use).
    """

    def __init__(
        self, vocab: int, length: int, successors: int = 4, zipf: float = 1.0, seed: int = 0
    ):
        for name, value in (("vocab", vocab), ("length", length), ("successors", successors)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if zipf < 0:
            raise ValueError(f"zipf must be >= 0, got {zipf}")
        self.vocab, self.length, self.successors = vocab, length, successors
        rng = np.random.default_rng(seed)
        popularity = np.arange(1, vocab + 1, dtype=np.float64) ** -zipf
        self.popularity = (popularity / popularity.sum())[rng.permutation(vocab)]
        #: ``next_tokens[t]``: the tokens that may follow ``t``
        self.next_tokens = rng.choice(vocab, size=(vocab, successors), p=self.popularity)

    @property
    def loss_bound(self) -> float:
        """An upper bound on the best achievable loss, nats per token: ``log(successors)``."""
        return float(np.log(self.successors))

    def batch(self, size: int, seed: int | tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, next_tokens)``, both int32 ``[size, length]``, drawn with ``seed``."""
        rng = np.random.default_rng(seed)
        walk = np.empty((size, self.length + 1), dtype=np.int64)
        walk[:, 0] = rng.choice(self.vocab, size=size, p=self.popularity)
        choices = rng.integers(0, self.successors, size=(size, self.length))
        for i in range(self.length):
            walk[:, i + 1] = self.next_tokens[walk[:, i], choices[:, i]]
        walk = walk.astype(np.int32)
        return walk[:, :-1], walk[:, 1:]
