"""``horovodrun``, as the tests launch it: Horovod's own launcher without its start-up check
that Horovod was built with Gloo. That check forks a process that imports TensorFlow to read
one flag (~6 s of CPU on 2 cores, before any rank starts, in every launch); the tests read the
flag once, in the test process (``tests.test_horovod._require_horovod``)."""

from __future__ import annotations

import sys

from horovod.runner import launch

if __name__ == "__main__":
    launch.gloo_built = lambda verbose=False: True
    sys.exit(launch.run_commandline())
