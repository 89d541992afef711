"""What the benchmark trains: models, synthetic batches and the compressors it compares.

TensorFlow, Keras and tf_sparsify are imported inside the functions: the launcher that only
reads names and labels from here stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import keras

    import tf_sparsify as tfs

NUM_CLASSES = 10
# benchmark name -> label in tables
COMPRESSORS = {
    "identity": "Identity (dense)",
    "fp16": "FP16",
    "topk1": "TopK 1% + EF",
    "topk0.1": "TopK 0.1% + EF",
    "qsgd4": "QSGD s=4 (one bucket per tensor)",
    # overlap probes: the two halves of a TopK 1% step, each alone
    "compute": "compute only (local SGD, no exchange)",
    "compute_sync": "compute + lockstep (local SGD, a 1-float all-reduce per step)",
    "exchange_topk1": "TopK 1% exchange only",
    # MultiWorkerMirroredStrategy: TopK 1% trained by a custom loop instead of model.fit
    "loop_topk1": "TopK 1% + EF, custom loop (strategy.run)",
}
#: names in COMPRESSORS that are probes, not compressors
PROBES = ("compute", "compute_sync", "exchange_topk1", "loop_topk1")
#: the probes each backend runs
BACKEND_PROBES = {
    "horovod": ("compute", "compute_sync", "exchange_topk1"),
    "mwms": ("compute", "loop_topk1"),
}
MODELS = ("mlp10m", "mobilenetv2", "tiny")


def mlp(input_size: int, widths: tuple[int, ...]) -> keras.Model:
    """A ReLU MLP ``input_size -> widths... -> 10`` (logits)."""
    import keras

    layers: list[Any] = [keras.Input((input_size,))]
    layers += [keras.layers.Dense(w, activation="relu") for w in widths]
    layers.append(keras.layers.Dense(NUM_CLASSES))
    return keras.Sequential(layers)


def input_shape(model: str, image_size: int) -> tuple[int, ...]:
    """The shape of one example of ``model``'s synthetic data."""
    return (image_size, image_size, 3) if model == "mobilenetv2" else (784,)


def make_model(model: str, image_size: int, seed: int) -> keras.Model:
    """``mlp10m`` (784->2048x3->10, 10.0M parameters), ``mobilenetv2`` (Keras' MobileNetV2,
    ``weights=None``, 158 trainable tensors) or ``tiny`` (784->64->10, for --quick). The same
    seed on every process gives every process the same initial weights."""
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
    raise ValueError(f"model {model!r}: choose from {MODELS}")


def synthetic_batch(
    model: str, image_size: int, batch: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """One fixed random batch (float32 inputs, int32 labels), reused every step."""
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
        "topk1": lambda: tfs.TopK(ratio=0.01),
        "topk0.1": lambda: tfs.TopK(ratio=0.001),
        "qsgd4": lambda: tfs.QSGD(levels=4),
    }
    if name not in factories:
        raise ValueError(f"compressor {name!r}: choose from {tuple(factories)}")
    return factories[name]()
