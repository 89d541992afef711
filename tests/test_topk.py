"""TopK's bfloat16 values on float32/float64 accumulators: the rounding error kept exactly,
denormals flushed as documented, the same eagerly, in graphs and under XLA."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs

TINY32 = float(np.finfo(np.float32).tiny)  # 2**-126, float32's smallest normal number
BF16 = ml_dtypes.bfloat16
BF16_MAX = float(ml_dtypes.finfo(BF16).max)


def _topk_bf16(acc: np.ndarray, dtype=tf.float32):
    """All entries sent as bfloat16 with error feedback on a zero residual; (sent values in the
    accumulator's dtype, new residual)."""
    comp = tfs.TopK(k=acc.size, value_dtype="bfloat16")
    x = tf.constant(acc, dtype)
    payload, ctx, residual = comp.compress_compensated(x, tf.zeros_like(x))
    assert payload[0].dtype == tf.bfloat16
    return comp.decompress(payload, ctx).numpy(), residual.numpy()


def test_topk_bfloat16_conserves_normal_range_accumulators_exactly():
    """``sent + residual == acc`` bit for bit wherever the rounding error is zero or normal:
    values from float32's smallest normal up (it, its neighbours in bfloat16, values whose
    error is exactly 2**-126), saturated extremes, and random values of every magnitude from
    2**-102 (below it the error of some values is a float32 denormal) to 1e38."""
    rng = np.random.default_rng(0)
    special = [
        TINY32,
        -TINY32,
        TINY32 * (1 + 2.0**-7),  # bfloat16-exact: error 0
        TINY32 * 2**23 * (1 + 2.0**-23),  # error exactly 2**-126: normal, kept
        -TINY32 * 2**23 * (1 + 3 * 2.0**-23),
        float(np.finfo(np.float32).max),  # saturates to bfloat16's max, excess kept
        -float(np.finfo(np.float32).max),
        1.0 + 2.0**-9,  # a tie, rounds to even
        0.0,
    ]
    exponents = rng.uniform(np.log2(2.0**-102), np.log2(1e38), size=4000)
    randoms = rng.choice([-1.0, 1.0], size=4000) * 2.0**exponents
    acc = np.concatenate([special, randoms]).astype(np.float32)
    sent, residual = _topk_bf16(acc)
    rounded = np.clip(acc.astype(BF16).astype(np.float64), -BF16_MAX, BF16_MAX)
    np.testing.assert_array_equal(sent, rounded.astype(np.float32))
    np.testing.assert_array_equal(sent.astype(np.float64) + residual.astype(np.float64), acc)
    assert np.count_nonzero(residual) > 3000  # the rounding errors are really kept
    assert residual[3] == TINY32  # the smallest normal error is kept


def test_topk_bfloat16_flushes_denormal_rounding_errors_and_accumulators():
    """The documented policy: a rounding error below 2**-126 is flushed to zero (the reported
    case: acc = -1.3011386e-38 sends -1.30406e-38 and keeps 0, not -2.9e-41), and an
    accumulator entry below 2**-126 counts as zero (the fused op reads denormals as zero).
    Each loss is below 2**-126; nothing above it is lost."""
    acc = np.array(
        [-1.3011386e-38, TINY32 * (1 + 2.0**-20), 3e-37, -1e-40, TINY32 / 2, 1.0], np.float32
    )
    sent, residual = _topk_bf16(acc)
    error = acc.astype(np.float64) - acc.astype(BF16).astype(np.float64)
    assert np.all(np.abs(error[:3]) < TINY32) and np.all(error[:3] != 0)  # denormal errors
    np.testing.assert_array_equal(sent[:3], acc[:3].astype(BF16).astype(np.float32))
    np.testing.assert_array_equal(sent[3:5], [0, 0])  # denormal accumulators: read as zero
    assert sent[5] == 1.0
    np.testing.assert_array_equal(residual, np.zeros_like(residual))
    assert np.all(np.abs(sent.astype(np.float64) + residual - acc) < TINY32)


def test_topk_bfloat16_on_float64_keeps_errors_below_float32s_range():
    """For float64 accumulators the threshold is float64's smallest normal: the error of
    -1.3011386e-38 (2.9e-41, normal in float64) is kept exactly."""
    acc = np.array([-1.3011386e-38, 1e-300, 1.0 + 2.0**-12], np.float64)
    sent, residual = _topk_bf16(acc, tf.float64)
    assert residual[0] != 0 and abs(residual[0]) < TINY32
    np.testing.assert_array_equal(sent + residual, acc)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_topk_bfloat16_denormal_policy_is_the_same_in_graphs_and_xla(jit_compile):
    """Inside tf.function and XLA (where constant folding or fusion could round otherwise) the
    flushed error and the kept normal one are the same as eagerly."""
    comp = tfs.TopK(k=3, value_dtype="bfloat16")
    acc = np.array([-1.3011386e-38, TINY32 * 2**23 * (1 + 2.0**-23), 2.5 + 2.0**-10], np.float32)

    @tf.function(jit_compile=jit_compile)
    def run(x):
        payload, ctx, residual = comp.compress_compensated(x, tf.zeros_like(x))
        return comp.decompress(payload, ctx), residual

    sent, residual = (t.numpy() for t in run(tf.constant(acc)))
    np.testing.assert_array_equal(residual[0], 0.0)
    np.testing.assert_array_equal(sent[1:].astype(np.float64) + residual[1:], acc[1:])
    assert residual[1] == TINY32 and residual[2] == 2.0**-10
