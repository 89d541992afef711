"""Run ``MultiWorkerMirroredStrategy`` workers as processes on this machine.

Each worker gets a ``TF_CONFIG`` naming every worker at ``localhost:<free port>`` and its own
index. :func:`run_local_workers` never hangs: when one worker fails or the time runs out, every
worker is killed and the call raises with the workers' output.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that were free on localhost a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("localhost", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(ports: Sequence[int], index: int) -> str:
    """The ``TF_CONFIG`` JSON of worker ``index`` in a localhost cluster on ``ports``."""
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def run_local_workers(
    args: Sequence[str],
    num_workers: int = 2,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run ``python *args`` once per worker, each with its ``TF_CONFIG``; return their outputs.

    Workers see no GPU (``CUDA_VISIBLE_DEVICES=""``), so each has one CPU device. Raises
    ``RuntimeError`` when a worker exits with an error and ``TimeoutError`` after ``timeout``
    seconds; in both cases all workers are killed first.
    """
    ports = free_ports(num_workers)
    with tempfile.TemporaryDirectory() as logs:
        procs, files, timed_out = [], [], False
        try:
            for index in range(num_workers):
                log = open(os.path.join(logs, f"worker{index}.log"), "w+")
                files.append(log)
                worker_env = {
                    **os.environ,
                    **(env or {}),
                    "TF_CONFIG": tf_config(ports, index),
                    "CUDA_VISIBLE_DEVICES": "",
                }
                procs.append(
                    subprocess.Popen(
                        [sys.executable, *args],
                        env=worker_env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                timed_out = time.monotonic() > deadline
                if timed_out or any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            outputs = []
            for log in files:
                log.seek(0)
                outputs.append(log.read())
                log.close()
    codes = [p.returncode for p in procs]
    if any(code != 0 for code in codes):
        report = "\n".join(
            f"--- worker {i} (exit {c}):\n{o[-3000:]}"
            for i, (c, o) in enumerate(zip(codes, outputs, strict=True))
        )
        if timed_out:
            raise TimeoutError(f"workers did not finish within {timeout} s\n{report}")
        raise RuntimeError(f"a worker failed\n{report}")
    return outputs
