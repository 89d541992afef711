"""``horovodrun`` as the benchmarks and tests launch it: Horovod's own launcher without its
start-up check that Horovod was built with Gloo.

That check forks a process that imports TensorFlow to read one flag: about 7 s of CPU and of
wall time before any rank starts, at every launch. The ranks read the flag instead, where
TensorFlow is imported anyway (:func:`require_gloo`); the tests read it once, in the test
process.

    python benchmarks/horovodrun.py -np 2 -H localhost:2 --gloo python train.py
"""

from __future__ import annotations

import os
import sys

#: the launcher's command line, before horovodrun's arguments
COMMAND = (sys.executable, os.path.abspath(__file__))


def require_gloo() -> None:
    """Raise, saying how to build it, unless this rank's Horovod has Gloo (what ``horovodrun``
    would have checked before starting the rank)."""
    import horovod.tensorflow as hvd

    if not hvd.gloo_built():
        raise SystemExit("Horovod was built without Gloo: rebuild it with `make horovod`.")


if __name__ == "__main__":
    from horovod.runner import launch

    launch.gloo_built = lambda verbose=False: True
    sys.exit(launch.run_commandline())
