"""Runs Python scripts, each in a fork of one interpreter that has already imported
TensorFlow, Keras, tf_sparsify and scikit-learn, so a script skips the ~5 s of imports.

Only imports happen before the fork: TensorFlow's runtime is not started (a script may still
configure its devices), and no thread but the main one holds Python state. The server reads one
JSON request a line on stdin, ``{"script": PATH, "output": FILE, "timeout": S}``, runs the
script as ``__main__`` in a child (in its folder, stdout and stderr into ``output``, stdin
empty) and answers one JSON line on stdout, ``{"returncode": N}``: the exit status,
``-signal`` when killed, ``null`` when it ran past ``timeout`` and was killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import keras  # noqa: F401  (imported once, for every script)
import sklearn.datasets  # noqa: F401
import tensorflow as tf  # noqa: F401
from script_runner import run_script

import tf_sparsify  # noqa: F401

POLL_S = 0.02


def _run_child(script: str, output: str) -> None:
    """In the fork: run ``script`` with stdout and stderr into ``output``, then exit."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    log = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    code = run_script(script)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait(pid: int, timeout: float) -> int | None:
    """The child's exit status (``-signal`` if a signal ended it), or None after killing it
    at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(POLL_S)


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _run_child(request["script"], request["output"])
            finally:
                os._exit(1)
        returncode = _wait(pid, float(request["timeout"]))
        print(json.dumps({"returncode": returncode}), flush=True)


if __name__ == "__main__":
    serve()
