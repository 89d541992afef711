"""Private network namespaces whose loopback is rate-limited with ``tc tbf``.

Every process of a benchmark job runs inside a namespace made here (``ip netns exec``), so its
traffic to 127.0.0.1 crosses a loopback limited to the rate asked for and nothing else on the
machine is touched. A namespace is always deleted, after every process still inside it has been
killed. Needs root and iproute2 (``ip``, ``tc``); :func:`unavailable_reason` says why not.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

UNLIMITED = "unlimited"
# Set to 1 to run as if there were no root (tests use it for the fallback path).
PRETEND_NO_ROOT_ENV = "TF_SPARSIFY_BENCH_NO_ROOT"
BURST = "512kb"
LATENCY = "100ms"
COMMAND_TIMEOUT_S = 30
_RATE = re.compile(r"^\d+(\.\d+)?[kmgt]?bit$")
_names = itertools.count()


def check_rate(rate: str) -> str:
    """``rate`` if it is ``unlimited`` or a tc rate (``100mbit``, ``1gbit``); else ValueError."""
    if rate != UNLIMITED and not _RATE.match(rate):
        raise ValueError(f"rate {rate!r}: expected 'unlimited' or a tc rate like 1gbit, 100mbit")
    return rate


def _ip(*args: str) -> None:
    """Run ``ip ARGS`` (or ``ip netns exec NS tc ...``); CalledProcessError with its stderr."""
    subprocess.run(
        ["ip", *args], check=True, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )


def _pids(name: str) -> list[int]:
    """The processes inside namespace ``name``."""
    found = subprocess.run(
        ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )
    return [int(pid) for pid in found.stdout.split()]


def _kill_inside(name: str) -> None:
    """SIGKILL every process still inside namespace ``name`` (only ours can be there)."""
    for pid in _pids(name):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextmanager
def shaped_namespace(rate: str) -> Iterator[list[str]]:
    """A fresh namespace with loopback up and limited to ``rate`` (no qdisc for ``unlimited``).

    Yields the command prefix that runs a command inside it. On exit, also on errors and
    Ctrl-C, every process left inside is killed and the namespace deleted.
    """
    check_rate(rate)
    name = f"tfs_bench_{os.getpid()}_{next(_names)}"
    _ip("netns", "add", name)
    try:
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        if rate != UNLIMITED:
            qdisc = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate]
            _ip("netns", "exec", name, *qdisc, "burst", BURST, "latency", LATENCY)
        yield ["ip", "netns", "exec", name]
    finally:
        _kill_inside(name)
        _ip("netns", "del", name)


def unavailable_reason() -> str | None:
    """Why rate-limited namespaces cannot be made here, or None when they can (checked by
    making one limited to 1gbit and deleting it)."""
    if os.environ.get(PRETEND_NO_ROOT_ENV) == "1":
        return f"{PRETEND_NO_ROOT_ENV}=1 (pretending there is no root)"
    if os.geteuid() != 0:
        return "not running as root (network namespaces and tc need root)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (
            f"{' and '.join(missing)} not found: install iproute2 (scripts/install_system_deps.sh)"
        )
    try:
        with shaped_namespace("1gbit"):
            pass
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        detail = getattr(error, "stderr", "") or ""
        return f"could not make a rate-limited namespace ({' '.join(error.cmd)}): {detail.strip()}"
    return None
