"""What the benchmark trains: models, synthetic batches and the compressors it compares.

TensorFlow, Keras and tf_sparsify are imported inside the functions: the launcher that only
reads names and labels from here stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.network.language import MarkovLanguage

if TYPE_CHECKING:
    import keras

    import tf_sparsify as tfs

NUM_CLASSES = 10
# benchmark name -> label in tables
COMPRESSORS = {
    "identity": "Identity (dense)",
    "fp16": "FP16",
    "bf16": "BF16",
    "topk1": "TopK 1% + EF",
    "topk0.1": "TopK 0.1% + EF",
    "qsgd4": "QSGD s=4 (one bucket per tensor)",
    "auto": "Auto (AutoCompression)",
    # one-step-late buckets (late_buckets): the last bucket for TopK, every bucket for dense
    "topk1_late": "TopK 1% + EF, last bucket a step late",
    "identity_late": "Identity (dense), every bucket a step late",
    "fp16_late": "FP16, every bucket a step late",
    # overlap probes: a step's two halves, each alone
    "compute": "compute only (local SGD, no exchange)",
    "compute_sync": "compute + lockstep (local SGD, a 1-float all-reduce per step)",
    "exchange_topk1": "TopK 1% exchange only",
    "exchange_identity": "Identity (dense) exchange only",
    "exchange_fp16": "FP16 exchange only",
    # MultiWorkerMirroredStrategy: TopK 1% trained by a custom loop instead of model.fit
    "loop_topk1": "TopK 1% + EF, custom loop (strategy.run)",
}
#: late variants: benchmark name -> (the compressor's benchmark name, ``late_buckets``)
LATE = {
    "topk1_late": ("topk1", "last"),
    "identity_late": ("identity", "all"),
    "fp16_late": ("fp16", "all"),
}
#: exchange-only probes: benchmark name -> the compressor whose payloads it moves
EXCHANGE_ONLY = {
    "exchange_topk1": "topk1",
    "exchange_identity": "identity",
    "exchange_fp16": "fp16",
}
#: names in COMPRESSORS that are probes, not compressors
PROBES = ("compute", "compute_sync", *EXCHANGE_ONLY, "loop_topk1")
#: the probes each backend runs
BACKEND_PROBES = {
    "horovod": ("compute", "compute_sync", *EXCHANGE_ONLY),
    "mwms": ("compute", "loop_topk1"),
}


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer's sizes: ``layers`` blocks of ``heads``-head causal
    self-attention and a ``d_model -> mlp -> d_model`` GELU MLP, over ``vocab`` tokens and
    sequences of ``length``."""

    vocab: int
    length: int
    d_model: int
    layers: int
    heads: int
    mlp: int


#: the transformers by benchmark name (parameter counts: :func:`transformer`)
TRANSFORMERS = {
    "transformer": TransformerShape(
        vocab=32000, length=128, d_model=512, layers=6, heads=8, mlp=2048
    ),
    "transformer_tiny": TransformerShape(
        vocab=256, length=16, d_model=32, layers=2, heads=2, mlp=64
    ),
}
MODELS = ("mlp10m", "mobilenetv2", "tiny", *TRANSFORMERS)
#: throughput batch per process, by model (about 1 s per compute-only step on one core here
#: for the transformer)
BATCH = {"mlp10m": 64, "mobilenetv2": 64, "tiny": 64, "transformer": 4, "transformer_tiny": 8}
#: the model ``--quick`` runs in place of each model
QUICK_MODELS = {"mlp10m": "tiny", "mobilenetv2": "tiny", "transformer": "transformer_tiny"}


def mlp(input_size: int, widths: tuple[int, ...]) -> keras.Model:
    """A ReLU MLP ``input_size -> widths... -> 10`` (logits)."""
    import keras

    layers: list[Any] = [keras.Input((input_size,))]
    layers += [keras.layers.Dense(w, activation="relu") for w in widths]
    layers.append(keras.layers.Dense(NUM_CLASSES))
    return keras.Sequential(layers)


def transformer(shape: TransformerShape) -> keras.Model:
    """A pre-LayerNorm decoder-only transformer: token ids ``[batch, length]`` -> next-token
    logits ``[batch, length, vocab]``.

    Token embedding (``keras.layers.Embedding``: its gradient is a ``tf.IndexedSlices`` over
    the rows a batch touches, the only sparse gradient) times sqrt(d_model) plus fixed
    sinusoidal positions (no weights), ``layers`` blocks (LayerNorm, ``MultiHeadAttention`` with a
    causal mask, residual; LayerNorm, MLP, residual), a final LayerNorm and a separate output
    ``Dense(vocab)``. Not tied to the embedding: a tied output's gradient is dense over every
    row (the softmax touches the whole vocabulary), so the embedding's gradient would be dense
    too and nothing would show what sparse gradients cost. No dropout.

    ``transformer`` (32000 tokens, length 128, d_model 512, 6 layers, 8 heads, MLP 2048) has
    51,715,328 parameters in 101 tensors: embedding 16,384,000; blocks 6 x 3,152,384 =
    18,914,304 (16 tensors each); final LayerNorm 1,024; output 16,416,000 (kernel and bias).
    ``transformer_tiny`` (256 tokens, length 16, d_model 32, 2 layers, 2 heads, MLP 64) has
    33,792: embedding 8,192; blocks 17,088; final LayerNorm 64; output 8,448.
    """
    import keras

    tokens = keras.Input((shape.length,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(shape.vocab, shape.d_model, name="token_embedding")(tokens)
    # scaled as in "Attention Is All You Need": the positions must not drown the tokens
    x = x * np.sqrt(shape.d_model) + sinusoidal_positions(shape.length, shape.d_model)
    for block in range(shape.layers):
        h = keras.layers.LayerNormalization(name=f"block{block}_attention_norm")(x)
        h = keras.layers.MultiHeadAttention(
            shape.heads, shape.d_model // shape.heads, name=f"block{block}_attention"
        )(h, h, use_causal_mask=True)
        x = keras.layers.Add()([x, h])
        h = keras.layers.LayerNormalization(name=f"block{block}_mlp_norm")(x)
        h = keras.layers.Dense(shape.mlp, activation="gelu", name=f"block{block}_mlp_in")(h)
        h = keras.layers.Dense(shape.d_model, name=f"block{block}_mlp_out")(h)
        x = keras.layers.Add()([x, h])
    x = keras.layers.LayerNormalization(name="final_norm")(x)
    logits = keras.layers.Dense(shape.vocab, name="output")(x)
    return keras.Model(tokens, logits, name="transformer")


def sinusoidal_positions(length: int, d_model: int) -> np.ndarray:
    """The fixed ``[length, d_model]`` position code of "Attention Is All You Need": sines in
    the even columns, cosines in the odd ones, wavelengths from 2 pi to 10000 * 2 pi."""
    position = np.arange(length)[:, None]
    frequency = 10000.0 ** (-np.arange(0, d_model, 2) / d_model)
    code = np.zeros((length, d_model), dtype=np.float32)
    code[:, 0::2] = np.sin(position * frequency)
    code[:, 1::2] = np.cos(position * frequency[: d_model // 2])
    return code


def input_shape(model: str, image_size: int) -> tuple[int, ...]:
    """The shape of one example of ``model``'s synthetic data."""
    if model in TRANSFORMERS:
        return (TRANSFORMERS[model].length,)
    return (image_size, image_size, 3) if model == "mobilenetv2" else (784,)


def make_model(model: str, image_size: int, seed: int) -> keras.Model:
    """``mlp10m`` (784->2048x3->10, 10.0M parameters), ``mobilenetv2`` (Keras' MobileNetV2,
    ``weights=None``, 158 trainable tensors), ``tiny`` (784->64->10, for --quick) or a
    transformer of :data:`TRANSFORMERS` (see :func:`transformer`). The same seed on every
    process gives every process the same initial weights."""
    import keras

    keras.utils.set_random_seed(seed)
    if model == "mlp10m":
        return mlp(784, (2048, 2048, 2048))
    if model == "mobilenetv2":
        return keras.applications.MobileNetV2(
            weights=None,
            input_shape=input_shape(model, image_size),
            classes=NUM_CLASSES,
            classifier_activation=None,
        )
    if model == "tiny":
        return mlp(784, (64,))
    if model in TRANSFORMERS:
        return transformer(TRANSFORMERS[model])
    raise ValueError(f"model {model!r}: choose from {MODELS}")


@cache
def language(model: str) -> MarkovLanguage:
    """The synthetic language a transformer of :data:`TRANSFORMERS` reads (seed 0: the same
    chain in every process)."""
    shape = TRANSFORMERS[model]
    return MarkovLanguage(shape.vocab, shape.length, seed=0)


def synthetic_batch(
    model: str, image_size: int, batch: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """One fixed batch, reused every step: random float32 inputs and int32 class labels, or,
    for a transformer, int32 token ids of :func:`language` and their next tokens."""
    if model in TRANSFORMERS:
        return language(model).batch(batch, seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *input_shape(model, image_size)), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, batch).astype(np.int32)
    return x, y


def make_compressor(name: str) -> tfs.Compressor:
    """A fresh compressor by its benchmark name (see :data:`COMPRESSORS`)."""
    import tf_sparsify as tfs

    factories = {
        "identity": lambda: tfs.Identity(),
        "fp16": lambda: tfs.FP16(),
        "bf16": lambda: tfs.BF16(),
        "topk1": lambda: tfs.TopK(ratio=0.01),
        "topk0.1": lambda: tfs.TopK(ratio=0.001),
        "qsgd4": lambda: tfs.QSGD(levels=4),
        "auto": lambda: tfs.Auto(),
    }
    if name not in factories:
        raise ValueError(f"compressor {name!r}: choose from {tuple(factories)}")
    return factories[name]()


def exchange_setup(
    name: str, bucket_bytes: int | None = None
) -> tuple[tfs.Compressor, dict[str, Any]]:
    """The compressor and the exchange options of a benchmark name (an exchange-only probe's:
    the compressor whose payloads it moves; another probe's: TopK 1%), with ``bucket_bytes``
    when given."""
    if name in PROBES:
        name = EXCHANGE_ONLY.get(name, "topk1")
    base, late = LATE.get(name, (name, "none"))
    options: dict[str, Any] = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    if late != "none":
        options["late_buckets"] = late
    return make_compressor(base), options
