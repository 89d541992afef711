"""MultiWorkerMirroredStrategy: two real worker processes on localhost, against a hand-written loop.

The workers run ``examples/multiworker_custom_loop.py`` (TopK + error feedback, QSGD with int8
payloads, TernGrad with uint8 payloads, TopK delayed by 2 steps). The reference recomputes the same
training on one device with the compressors called directly: each worker's gradient of its
scaled local loss, compressed with the worker's RNG key, decompressed, summed, applied by SGD.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import numpy as np
import pytest
import tensorflow as tf

from tf_sparsify.distribute import run_local_workers

pytestmark = pytest.mark.processes  # worker processes

WORKERS = 2
STEPS = 8
BATCH = 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
    path = os.path.join(ROOT, "examples", "multiworker_custom_loop.py")
    spec = importlib.util.spec_from_file_location("multiworker_custom_loop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(ex, config: str) -> list[np.ndarray]:
    """The training of ``config`` by hand: compressors, residuals and delays written out."""
    x, y = ex.make_data()
    model = ex.make_model()
    variables = model.trainable_variables
    compressor = ex.make_compressor(config)
    delay = ex.config_delay(config)
    residuals = [[tf.zeros_like(v) for v in variables] for _ in range(WORKERS)]
    history = []
    for step in range(STEPS):
        contributions = []
        for p in range(WORKERS):
            xb, yb = ex.worker_batch(x, y, p, WORKERS, step, BATCH)
            with tf.GradientTape() as tape:
                loss = ex.local_loss(model, tf.constant(xb), tf.constant(yb), WORKERS)
            grads = tape.gradient(loss, variables)
            parts = []
            for i, g in enumerate(grads):
                if compressor.unbiased:
                    payload, ctx = compressor.compress(g, step, i, p)
                else:
                    payload, ctx, residuals[p][i] = compressor.compress_with_feedback(
                        g, residuals[p][i], step, i, p
                    )
                parts.append(compressor.decompress(payload, ctx))
            contributions.append(parts)
        history.append([sum(c[i] for c in contributions) for i in range(len(variables))])
        if step >= delay:
            for v, update in zip(variables, history[step - delay], strict=True):
                v.assign_sub(ex.LEARNING_RATE * update)
    return [v.numpy() for v in variables]


def test_two_workers_match_hand_written_training(tmp_path):
    ex = _example()
    args = argparse.Namespace(
        workers=WORKERS,
        configs=",".join(ex.CONFIGS),
        steps=STEPS,
        batch=BATCH,
        timeout=120,
        out=str(tmp_path),
    )
    results = ex.launch(args)
    assert set(results) == set(ex.CONFIGS)
    for config, (first, second) in results.items():
        for a, b in zip(first, second, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{config}: workers differ")
        expected = _reference(ex, config)
        initial = [v.numpy() for v in ex.make_model().trainable_variables]
        for got, want, start in zip(first, expected, initial, strict=True):
            assert np.abs(want - start).max() > 1e-3, f"{config}: reference did not move"
            np.testing.assert_allclose(got, want, atol=2e-5, err_msg=config)


def test_failed_worker_kills_the_others():
    code = "import os, sys, time; "
    code += "sys.exit(3) if '\"index\": 1' in os.environ['TF_CONFIG'] else time.sleep(60)"
    with pytest.raises(RuntimeError, match="exit 3"):
        run_local_workers(["-c", code], num_workers=2, timeout=30)


def test_stuck_workers_time_out():
    with pytest.raises(TimeoutError, match="did not finish"):
        run_local_workers(["-c", "import time; time.sleep(60)"], num_workers=2, timeout=1)


def test_workers_get_their_own_tf_config():
    code = "import json, os; c = json.loads(os.environ['TF_CONFIG']); "
    code += "print(c['task']['index'], len(c['cluster']['worker']), "
    code += "repr(os.environ['CUDA_VISIBLE_DEVICES']))"
    outputs = run_local_workers(["-c", code], num_workers=3, timeout=30)
    assert [o.split() for o in outputs] == [[str(i), "3", "''"] for i in range(3)]
