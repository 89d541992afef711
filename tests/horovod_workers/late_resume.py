"""A fresh ``horovodrun -np 2`` launch resumes from the checkpoint that ``restart.py`` wrote
inside ``fit`` with a gradient in flight on each rank (its folder is the argument): every rank
restores it, trains the remaining epoch, and must end with the weights of the run that never
stopped, which that launch saved per rank.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import restart
import tensorflow as tf
from common import Checks, hvd

FOLDER = sys.argv[1]


def resume() -> dict:
    model, optimizer = restart.model_and_optimizer("last")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    checkpoint.read(os.path.join(FOLDER, "keras_late")).assert_consumed()
    restart.fit(model, 1)
    with np.load(os.path.join(FOLDER, f"keras_late_straight_{hvd.rank()}.npz")) as saved:
        want = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    return {
        "max_difference": max(
            float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), want, strict=True)
        ),
        "iterations": int(optimizer.iterations.numpy()),
    }


def main() -> None:
    checks = Checks()
    checks.run("keras_late_fresh_processes", resume)
    checks.exit()


if __name__ == "__main__":
    main()
