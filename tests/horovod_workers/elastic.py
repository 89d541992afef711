"""Elastic Horovod with tf_sparsify error memory, under ``horovodrun --min-np 1 --max-np 2
--host-discovery-script --blacklist-cooldown-range 1 2`` on localhost (two host names for the
one machine: ``localhost`` and ``127.0.0.1``).

Two workers train; the one on ``127.0.0.1`` kills itself (SIGKILL) right after a commit, the
other goes on alone, and after the cooldown a new worker comes back on ``127.0.0.1``. Each
(re)start of the training function prints a ``sync`` ``RESULT`` line: the job size, this
worker's residual sum, the sum over all workers at the last commit, and whether the workers'
weights agree. The test reads from them:

- after the kill, the survivor's residuals hold the job's whole committed error memory (its
  own plus the lost worker's);
- the worker that comes back starts from zero error memory, with the survivor's weights.

``python elastic.py FRONT_END FOLDER``: FRONT_END is ``exchange`` (GradientExchange) or
``keras`` (DistributedOptimizer applied in a custom loop); FOLDER holds the flag of the kill.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import keras
import numpy as np
import tensorflow as tf
from common import PREFIX, hvd

import tf_sparsify as tfs
import tf_sparsify.horovod as th
from tf_sparsify.horovod import elastic

FRONT_END, FOLDER = sys.argv[1], sys.argv[2]
HOST = os.environ.get("HOROVOD_HOSTNAME", "")
LEAVE_AT, STEPS, MAX_STEPS = 4, 10, 600
SHAPES = [(6, 5), (5,)]


def report(check: str, **detail) -> None:
    print(PREFIX + json.dumps({"check": check, "host": HOST, **detail}, default=float), flush=True)


def gradients(step: int) -> list[tf.Tensor]:
    """This worker's gradients at ``step`` (seeded by its host name)."""
    rng = np.random.default_rng([sum(map(ord, HOST)), step])
    return [tf.constant(rng.normal(size=s).astype("float32")) for s in SHAPES]


def residual_sum(holder) -> float:
    residuals = [r for r in holder.residuals if r is not None]
    return float(sum(np.sum(r.numpy(), dtype=np.float64) for r in residuals))


variables = [tf.Variable(tf.zeros(s), name=f"w{i}") for i, s in enumerate(SHAPES)]
if FRONT_END == "exchange":
    holder = th.GradientExchange(tfs.TopK(k=3))
    holder.build(variables)
    sgd = keras.optimizers.SGD(0.1)
    sgd.build(variables)
else:
    holder = th.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5), tfs.TopK(k=3))
    holder.build(variables)
state = th.ElasticState(
    variables, holder, step=0, was_alone=False, back=False, together=0, world_residual=0.0
)


def one_step(grads):
    if FRONT_END == "exchange":
        sgd.apply(holder.updates(grads, variables), variables)
    else:
        holder.apply(grads, variables)


@elastic.run
def train(state) -> None:
    step_fn = tf.function(one_step)  # traced anew after every reset: the ranks changed
    state.was_alone = state.was_alone or hvd.size() == 1
    state.back = state.was_alone and hvd.size() == 2
    weights = hvd.allgather_object([v.numpy() for v in variables])
    same = all(np.array_equal(a, b) for w in weights for a, b in zip(w, weights[0], strict=True))
    report(
        "sync",
        size=hvd.size(),
        step=state.step,
        residual=residual_sum(holder),
        committed_total=state.world_residual,
        weights_equal=same,
    )
    while state.step < MAX_STEPS:
        if state.step >= STEPS and state.together >= 2:
            return
        step_fn(gradients(state.step))
        state.step += 1
        state.together += int(state.back)
        total = hvd.allreduce(tf.constant(residual_sum(holder), tf.float64), op=hvd.Sum)
        state.world_residual = float(total)
        state.commit()
        if HOST == "127.0.0.1" and state.step == LEAVE_AT and hvd.size() == 2:
            if not os.path.exists(os.path.join(FOLDER, "left")):
                open(os.path.join(FOLDER, "left"), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        if hvd.size() == 1:
            time.sleep(0.1)  # alone: give the killed worker's host time to come back
    raise RuntimeError(f"no worker came back within {MAX_STEPS} steps")


train(state)
report("done", size=hvd.size(), step=state.step)
