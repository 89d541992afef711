"""The warm-interpreter script runner the process tests use (``tests/fork_server.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.script_runner import ForkServer

SCRIPT = """
import atexit
import sys

atexit.register(print, "atexit ran")
print("argv", sys.argv[1:])
sys.exit(3)
"""


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    server = ForkServer()
    yield server
    server.close()


@pytest.mark.processes
def test_a_forked_script_ends_as_python_ends_it(server, tmp_path):
    script, output = tmp_path / "script.py", tmp_path / "out.txt"
    script.write_text(SCRIPT)
    request = {"script": str(script), "output": str(output), "timeout": 60, "argv": ["a"]}
    assert server.ask(request) == {"returncode": 3}
    # the atexit handlers run (Horovod's shutdown is one), after the script's own output
    assert output.read_text().splitlines() == ["argv ['a']", "atexit ran"]
