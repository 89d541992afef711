"""Runs Python scripts, each in a fork of one interpreter that has already imported
TensorFlow, Keras, tf_sparsify and scikit-learn, so a script skips the ~5 s of imports.

Only imports happen before the fork: TensorFlow's runtime is not started (a script may still
configure its devices), and no thread but the main one holds Python state. The server reads one
JSON request a line on stdin, ``{"script": PATH, "output": FILE, "timeout": S}`` (optionally
``"argv": [...]``, ``"env": {...}`` to add to its environment, ``"cwd": DIR`` to run it there
instead of in its folder, ``"errors": FILE`` for its stderr), runs the script as ``__main__``
in a child (stdout and stderr into ``output``, stdin empty) and answers one JSON line on
stdout, ``{"returncode": N}``: the exit status, ``-signal`` when killed, ``null`` when it ran
past ``timeout`` and was killed.

A request with ``"workers": [{"output": FILE, "env": {...}}, ...]`` instead of ``"output"``
runs one child per worker at once, each with its environment variables added (e.g. a
``MultiWorkerMirroredStrategy`` worker's ``TF_CONFIG``), as
:func:`tf_sparsify.distribute.run_local_workers` runs processes: when one exits non-zero or the
time runs out, the others are killed. It answers ``{"returncodes": [N, ...], "timed_out": B}``.

A request with ``"detach": true`` starts a child that outlives the request (a server of its
own, e.g. ``horovod_workers/forked_ranks.py serve``) and answers at once, ``{"pid": N}``; its
standard input is a pipe this server holds open until it exits, so the child reads end of file
when the test session is over.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time

import keras  # noqa: F401  (imported once, for every script)
import sklearn.datasets  # noqa: F401
import tensorflow as tf  # noqa: F401
from script_runner import exit_as_python, run_script

import tf_sparsify  # noqa: F401

# The imports' objects outlive every fork: never scanned by the collector, nor copied into a
# fork's pages when it would have touched them.
gc.freeze()

POLL_S = 0.02
#: a detached child's standard input: nothing is written, the write end closes with this server
LIFETIME_READ, LIFETIME_WRITE = os.pipe()


def _open_for_writing(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def _run_child(script: str, argv: list[str], request: dict) -> None:
    """In the fork: run ``script`` with stdout into ``request["output"]`` (stderr too, unless
    ``request["errors"]`` names a file for it), in ``request["cwd"]`` or the script's folder,
    then exit; a detached one reads :data:`LIFETIME_READ`."""
    os.close(LIFETIME_WRITE)
    os.dup2(LIFETIME_READ if request.get("detach") else os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(_open_for_writing(request["output"]), 1)
    os.dup2(_open_for_writing(request["errors"]) if "errors" in request else 1, 2)
    if "cwd" in request:
        os.chdir(request["cwd"])
    exit_as_python(run_script(script, argv, in_its_folder="cwd" not in request))


def _fork(script: str, argv: list[str], request: dict) -> int:
    """The pid of a child running ``script`` as ``request`` says, with ``request["env"]`` (if
    any) added to its environment."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.environ.update(request.get("env", {}))
            _run_child(script, argv, request)
        finally:
            os._exit(1)
    return pid


def _wait_all(pids: list[int], timeout: float) -> tuple[list[int], bool]:
    """Every child's exit status and whether the time ran out; once one has failed or the
    time is up, the others are killed."""
    codes: list[int | None] = [None] * len(pids)
    deadline = time.monotonic() + timeout
    timed_out = False
    while any(code is None for code in codes):
        for i, pid in enumerate(pids):
            if codes[i] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i] = os.waitstatus_to_exitcode(status)
        timed_out = time.monotonic() > deadline
        if timed_out or any(code not in (None, 0) for code in codes):
            for i, pid in enumerate(pids):
                if codes[i] is None:
                    os.kill(pid, signal.SIGKILL)
                    codes[i] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            break
        time.sleep(POLL_S)
    return codes, timed_out


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
        script, argv = request["script"], request.get("argv", [])
        if request.get("detach"):
            answer = {"pid": _fork(script, argv, request)}
        elif "workers" in request:
            pids = [_fork(script, argv, worker) for worker in request["workers"]]
            codes, timed_out = _wait_all(pids, float(request["timeout"]))
            answer = {"returncodes": codes, "timed_out": timed_out}
        else:
            pid = _fork(script, argv, request)
            answer = {"returncode": _wait(pid, float(request["timeout"]))}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    serve()
