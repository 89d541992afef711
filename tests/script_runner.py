"""Runs a Python script as ``python script`` would, inside an interpreter already running; and
the client of ``tests/fork_server.py``, which runs scripts so in forks of a warm interpreter."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from typing import NoReturn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script: str, argv: Sequence[str] = (), in_its_folder: bool = True) -> int:
    """Run ``script`` as ``__main__``, in its folder unless ``in_its_folder`` is False (then in
    the current one; ``sys.argv`` and ``sys.path[0]`` as
    ``python script *argv`` sets them); its exit status, 1 after an uncaught exception
    (traceback on stderr)."""
    folder = os.path.dirname(os.path.abspath(script))
    if in_its_folder:
        os.chdir(folder)
    sys.argv = [script, *argv]
    sys.path[0] = folder
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def exit_as_python(code: int) -> NoReturn:
    """End a forked child as the interpreter ends a process: run the ``atexit`` handlers
    (``hvd.shutdown`` among them: a rank that skips it resets its peers' connections while
    they still exchange, and they abort), flush the streams, then ``os._exit(code)``."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ForkServer:
    """Client of ``tests/fork_server.py`` (started with ``env`` added to this environment)."""

    def __init__(self, env: dict[str, str] | None = None):
        server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fork_server.py")
        self.process = subprocess.Popen(
            [sys.executable, server],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def ask(self, request: dict) -> dict:
        """The server's answer to ``request`` (see ``tests/fork_server.py``)."""
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer, f"the fork server exited with {self.process.wait()}"
        return json.loads(answer)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


_shared: list[ForkServer] = []


def shared_fork_server() -> ForkServer:
    """This process's warm interpreter for one-off scripts (the repository on its path, C++
    info logs off), started on first use and stopped when this process exits: the test files
    of one pytest worker share its ~5 s of imports."""
    if not _shared:
        _shared.append(ForkServer({"PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}))
        atexit.register(_shared[0].close)
    return _shared[0]


def run_forked(
    script: str,
    argv: Sequence[str] = (),
    env: dict[str, str] | None = None,
    cwd: str = ROOT,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``python script *argv`` in ``cwd`` with ``env`` added, run in a fork of
    :func:`shared_fork_server`: a process with TensorFlow imported but not started, as fresh as
    a new one for everything the script does after its imports. ``returncode`` is None when it
    ran past ``timeout`` and was killed."""
    with tempfile.TemporaryDirectory() as folder:
        output, errors = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        answer = shared_fork_server().ask(
            {
                "script": script,
                "argv": list(argv),
                "output": output,
                "errors": errors,
                "env": env or {},
                "cwd": cwd,
                "timeout": timeout,
            }
        )
        with open(output, encoding="utf-8", errors="replace") as out:
            with open(errors, encoding="utf-8", errors="replace") as err:
                return subprocess.CompletedProcess(
                    [script, *argv], answer["returncode"], out.read(), err.read()
                )


def run_forked_workers(
    script: str, argv: Sequence[str], envs: Sequence[dict[str, str]], timeout: float
) -> tuple[list[int | None], bool, list[str]]:
    """One fork of :func:`shared_fork_server` per environment in ``envs`` (e.g. each with its
    ``TF_CONFIG``), all running ``python script *argv`` at once in the script's folder, as
    ``tf_sparsify.distribute.run_local_workers`` runs processes: once one fails or the time is
    up, the others are killed. ``(exit statuses, whether the time ran out, outputs)``."""
    with tempfile.TemporaryDirectory() as folder:
        files = [os.path.join(folder, f"worker{i}.log") for i in range(len(envs))]
        answer = shared_fork_server().ask(
            {
                "script": script,
                "argv": list(argv),
                "timeout": timeout,
                "workers": [{"output": f, "env": e} for f, e in zip(files, envs, strict=True)],
            }
        )
        outputs = []
        for name in files:
            with open(name, encoding="utf-8", errors="replace") as f:
                outputs.append(f.read())
    return answer["returncodes"], answer["timed_out"], outputs
