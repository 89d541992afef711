"""Horovod ranks as forks of one warm interpreter: each skips the ~4 s of importing TensorFlow,
Keras, scikit-learn and tf_sparsify that a fresh ``python`` spends on 2 cores.

``python forked_ranks.py serve SOCKET`` listens on the Unix socket SOCKET, imports those
packages (nothing else: TensorFlow's runtime is not started, no thread is left running) and
forks a child per connection. ``python forked_ranks.py run SCRIPT ARGS...`` is what
``horovodrun`` starts for each rank instead of ``python SCRIPT ARGS...``: it imports nothing
heavy, hands the server its standard streams, environment (Horovod's variables included),
working directory and command line, and exits as the child running the script exits (killing
itself with the same signal when a signal ended it). A SIGTERM, SIGINT or SIGHUP to the client,
how Horovod stops its ranks, is passed on to the child; when the client is gone (SIGKILL) the
server kills its child. The server exits, killing its children, when its standard input closes
(the tests start it as a detached child of ``tests/fork_server.py``, which holds that pipe open
while it runs, so the server skips the imports too).
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import sys

from tests.script_runner import exit_as_python, run_script

SOCKET_ENV = "TF_SPARSIFY_TEST_RANK_SERVER"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
POLL_S = 0.02


# -- the client: one per rank ----------------------------------------------------------------
def client(script: str, argv: list[str]) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.connect(os.environ[SOCKET_ENV])
    request = {"script": script, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(server, [json.dumps(request).encode() + b"\n"], [0, 1, 2])

    def forward(signum, frame):
        try:
            server.sendall(f"KILL {signum}\n".encode())
        except OSError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = server.recv(64)
        if not chunk:
            sys.exit("forked_ranks: the server closed the connection without an exit status")
        answer += chunk
    code = int(answer.split()[1])
    if code < 0:  # the child died of a signal: so does this client
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # these two take no handler
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# -- the server ------------------------------------------------------------------------------
def _start(connection: socket.socket, others: list) -> int:
    """Reads a client's request and forks the child that runs it; the child's pid."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    while message and not message.endswith(b"\n"):
        more = connection.recv(1 << 20)
        if not more:
            break
        message += more
    request = json.loads(message)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for other in others:
                other.close()
            connection.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                if fd > 2:
                    os.close(fd)
            for signum in FORWARDED:
                signal.signal(signum, signal.SIG_DFL)
            os.environ.clear()
            os.environ.update(request["env"])
            os.chdir(request["cwd"])
            code = run_script(request["script"], request["argv"], in_its_folder=False)
            exit_as_python(code)
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    return pid


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    import keras  # noqa: F401  (imported once, for every rank)
    import sklearn.datasets  # noqa: F401
    import tensorflow  # noqa: F401

    import tf_sparsify  # noqa: F401

    gc.freeze()  # the imports' objects outlive every rank: the collector skips them
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select(timeout=POLL_S):
            if key.fileobj is listener:
                connection, _ = listener.accept()
                others = [listener, *children.values()]
                pid = _start(connection, others)
                children[pid] = connection
                selector.register(connection, selectors.EVENT_READ, pid)
            elif key.fileobj is sys.stdin:
                if not os.read(sys.stdin.fileno(), 1 << 16):  # the test session is over
                    for pid in children:
                        os.kill(pid, signal.SIGKILL)
                    return
            else:
                try:
                    data = key.fileobj.recv(1 << 10)
                except OSError:
                    data = b""
                if not data:  # the client is gone: so goes its rank
                    selector.unregister(key.fileobj)
                    os.kill(key.data, signal.SIGKILL)
                for line in data.decode().splitlines():
                    os.kill(key.data, int(line.split()[1]))
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = children.pop(pid)
            try:
                selector.unregister(connection)
            except KeyError:
                pass
            try:
                connection.sendall(f"EXIT {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            connection.close()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        client(sys.argv[2], sys.argv[3:])
