"""Launch one job (``horovodrun`` or the MWMS launcher, with its workers) under a deadline.

Rank 0 appends JSON lines to a results file; :func:`run_job` hands each new line to a callback
while the job runs (progress), and on exit, error, timeout or Ctrl-C stops the launcher and
everything it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import psutil

from benchmarks.horovodrun import COMMAND as HOROVODRUN
from benchmarks.network.affinity import PIN_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLL_S = 0.25
TERMINATE_GRACE_S = 5.0
LOG_TAIL_CHARS = 6000


class JobFailed(RuntimeError):
    """A job exited with an error or ran past its deadline (the message has its log's tail)."""


def horovod_command(prefix: Sequence[str], ranks: int, worker: str, args: Sequence[str]) -> list:
    """``horovodrun -np P -H localhost:P --gloo python -m WORKER ARGS`` after ``prefix``
    (:mod:`benchmarks.horovodrun`: the ranks check that Horovod has Gloo)."""
    hosts = f"localhost:{ranks}"
    launch = [*HOROVODRUN, "-np", str(ranks), "-H", hosts, "--gloo", sys.executable, "-m", worker]
    return [*prefix, *launch, *args]


def mwms_command(prefix: Sequence[str], workers: int, timeout: float, args: Sequence[str]) -> list:
    """The MWMS launcher (``benchmarks.network.mwms_job``) for ``workers`` after ``prefix``."""
    launch = [sys.executable, "-m", "benchmarks.network.mwms_job"]
    return [*prefix, *launch, "--workers", str(workers), "--timeout", str(timeout), "--", *args]


def stop_tree(proc: subprocess.Popen) -> None:
    """Terminate ``proc`` and all its descendants, kill what is left after a grace period,
    then kill its process group (it was started in a session of its own)."""
    try:
        parent = psutil.Process(proc.pid)
        procs = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=TERMINATE_GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=TERMINATE_GRACE_S)


class LineReader:
    """Complete JSON lines appended to a file since the last call."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0

    def new_records(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]
        self.offset += len(complete.encode())
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


def _tail(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-LOG_TAIL_CHARS:]


def run_job(
    command: Sequence[str],
    results: str,
    log: str,
    timeout: float,
    on_record: Callable[[dict], None],
    pin: bool = False,
) -> list[dict]:
    """Run ``command`` (output to ``log``) for at most ``timeout`` seconds; pass every record
    rank 0 appends to ``results`` to ``on_record`` as it arrives; return all of them. ``pin``:
    each process takes its own share of the cores (see ``affinity.py``).
    Raises :class:`JobFailed` on a non-zero exit or at the deadline."""
    env = {
        **os.environ,
        PIN_ENV: "1" if pin else "0",
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
        "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
        "CUDA_VISIBLE_DEVICES": "",
    }
    reader, records = LineReader(results), []

    def drain() -> None:
        for record in reader.new_records():
            records.append(record)
            on_record(record)

    with open(log, "w") as out:
        proc = subprocess.Popen(
            list(command),
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                drain()
                time.sleep(POLL_S)
            drain()
        finally:
            finished = proc.poll() is not None
            stop_tree(proc)
    if not finished:
        what = f"job did not finish within {timeout:.0f} s"
        raise JobFailed(f"{what}: {' '.join(command)}\n{_tail(log)}")
    if proc.returncode != 0:
        raise JobFailed(f"job exited {proc.returncode}: {' '.join(command)}\n{_tail(log)}")
    return records
