"""Every ```python block of README.md and docs/**/*.md runs, so the documentation cannot drift
from the code.

Each block is a standalone script, run with a temporary directory as its working directory
(``TF_CPP_MIN_LOG_LEVEL=3``, no GPU), and must exit 0. An HTML comment on the line right before
the opening fence selects a launcher:

- ``<!-- example: horovod np=2 -->``: under ``horovodrun -np 2 --gloo``
  (:func:`tests.test_horovod.horovodrun`); the blocks of one ``np`` share a launch, one
  after another (``tests/horovod_scripts.py``), each in its own folder and with its own exit
  status per rank;
- ``<!-- example: multiworker workers=2 -->``: as 2 local ``MultiWorkerMirroredStrategy``
  workers with their ``TF_CONFIG``, forks of the warm interpreter below, killed together when
  one fails as :func:`tf_sparsify.distribute.run_local_workers` kills its processes.

Without a comment a block runs in one process: a fork of an interpreter that has imported
TensorFlow already (``tests/fork_server.py``; a fresh process for each block would spend ~5 s
of each on imports). Case ids are ``path:line`` of the opening fence.
"""

from __future__ import annotations

import glob
import os
import re
import textwrap
from dataclasses import dataclass

import pytest

from tests.script_runner import ROOT, run_forked, run_forked_workers
from tests.test_horovod import horovodrun
from tf_sparsify.distribute.multiworker import free_ports, tf_config

TIMEOUT_S = 240
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
# launcher -> the one argument it takes (the number of processes)
LAUNCHERS = {"python": None, "horovod": "np", "multiworker": "workers"}
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<launcher>\S+)(?P<args>.*?)\s*-->\s*$")
# tests/horovod_scripts.py's line after each script, as horovodrun prefixes it
SCRIPT_STATUS = re.compile(
    r"^\[(?P<rank>\d+)\]<stdout>:SCRIPT (?P<script>\S+) (?P<code>-?\d+)$", re.M
)


@dataclass(frozen=True)
class Example:
    """One python block: where it is, its code and how it is launched."""

    source: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str
    launcher: str = "python"
    processes: int = 1

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}"


def _launch_spec(marker: str, where: str) -> tuple[str, int]:
    """``(launcher, processes)`` from an ``<!-- example: ... -->`` comment."""
    found = MARKER.match(marker)
    launcher = found["launcher"] if found else None
    if launcher not in LAUNCHERS:
        raise ValueError(f"{where}: unknown example launcher in {marker.strip()!r}")
    args = dict(arg.split("=", 1) for arg in found["args"].split())
    argument = LAUNCHERS[launcher]
    if set(args) != ({argument} if argument else set()) or not all(
        v.isdigit() for v in args.values()
    ):
        raise ValueError(
            f"{where}: {launcher!r} takes {f'{argument}=N' if argument else 'no arguments'}, "
            f"got {marker.strip()!r}"
        )
    return launcher, int(args[argument]) if argument else 1


def parse(text: str, source: str) -> list[Example]:
    """The python blocks of Markdown ``text`` (named ``source`` in ids and errors)."""
    lines = text.splitlines()
    examples, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        start, indent, fence = i, opening["indent"], opening["fence"]
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{re.escape(fence)}\s*$", lines[i]):
            i += 1
        info = opening["info"].split()
        if info[:1] == ["python"]:
            body = [line.removeprefix(indent) for line in lines[start + 1 : i]]
            code = textwrap.dedent("\n".join(body)) + "\n"
            before = lines[start - 1] if start else ""
            where = f"{source}:{start + 1}"
            launcher, processes = _launch_spec(before, where) if "<!--" in before else ("python", 1)
            examples.append(Example(source, start + 1, code, launcher, processes))
        i += 1
    return examples


def documents() -> list[str]:
    """README.md and every page under docs/, relative to the repository root."""
    pages = glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    return ["README.md", *sorted(os.path.relpath(p, ROOT) for p in pages)]


def collect() -> list[Example]:
    examples = []
    for source in documents():
        with open(os.path.join(ROOT, source), encoding="utf-8") as f:
            examples += parse(f.read(), source)
    return examples


EXAMPLES = collect()


def run_workers(script: str, workers: int, timeout: float) -> tuple[list[int | None], str]:
    """``(exit statuses, outputs)`` of ``workers`` forks of the warm interpreter running
    ``script`` at once, each with its ``TF_CONFIG`` (``script_runner.run_forked_workers``)."""
    ports = free_ports(workers)
    env = [{**ENV, "TF_CONFIG": tf_config(ports, i)} for i in range(workers)]
    codes, _, outputs = run_forked_workers(script, [], env, timeout)
    report = [f"--- worker {i}:\n{output[-3000:]}" for i, output in enumerate(outputs)]
    return codes, "\n".join(report)


class HorovodBatches:
    """The horovod blocks of one ``np``, run in one launch (``tests/horovod_scripts.py``)."""

    def __init__(self, folder):
        self.folder = folder
        self.launches: dict[int, tuple[dict[str, dict[int, int]], dict[str, int], str]] = {}

    def run(self, example: Example) -> tuple[dict[int, int], str]:
        """``({rank: exit status}, the launch's output up to the end of ``example``)``."""
        if example.processes not in self.launches:
            self.launches[example.processes] = self._launch(example.processes)
        statuses, ends, out = self.launches[example.processes]
        return statuses.get(example.id, {}), out[: ends.get(example.id, len(out))]

    def _launch(self, ranks: int) -> tuple[dict[str, dict[int, int]], dict[str, int], str]:
        """``({block: {rank: exit status}}, {block: where its output ends}, the output)``."""
        scripts = {}
        for i, example in enumerate(EXAMPLES):
            if example.launcher == "horovod" and example.processes == ranks:
                script = self.folder / f"np{ranks}_{i}" / "example.py"
                script.parent.mkdir()
                script.write_text(example.code)
                scripts[str(script)] = example.id
        runner = os.path.join(ROOT, "tests", "horovod_scripts.py")
        timeout = TIMEOUT_S * len(scripts)
        _, out = horovodrun(runner, *scripts, ranks=ranks, timeout=timeout, cwd=str(self.folder))
        statuses: dict[str, dict[int, int]] = {}
        ends: dict[str, int] = {}
        for found in SCRIPT_STATUS.finditer(out):
            example_id = scripts[found["script"]]
            statuses.setdefault(example_id, {})[int(found["rank"])] = int(found["code"])
            ends[example_id] = found.end()
        return statuses, ends, out


@pytest.fixture(scope="module")
def horovod_batches(tmp_path_factory) -> HorovodBatches:
    return HorovodBatches(tmp_path_factory.mktemp("horovod_blocks"))


@pytest.mark.processes
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_example_runs(example: Example, tmp_path, monkeypatch, request):
    script = tmp_path / "example.py"
    script.write_text(example.code)
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    if example.launcher == "horovod":
        statuses, out = request.getfixturevalue("horovod_batches").run(example)
        assert statuses == dict.fromkeys(range(example.processes), 0), (
            f"{example.id} failed under horovodrun (exit status by rank {statuses}):\n{out[-6000:]}"
        )
    elif example.launcher == "multiworker":
        codes, out = run_workers(str(script), example.processes, TIMEOUT_S)
        assert codes == [0] * example.processes, (
            f"{example.id} failed as {example.processes} workers (exit statuses {codes}):\n{out}"
        )
    else:
        proc = run_forked(str(script), env=ENV, cwd=str(tmp_path), timeout=TIMEOUT_S)
        code, out = proc.returncode, proc.stdout + proc.stderr
        status = f"exit {code}" if code is not None else f"killed after {TIMEOUT_S} s"
        assert code == 0, f"{example.id} failed ({status}):\n{out[-6000:]}"


# -- the collector itself ------------------------------------------------------------------------


def test_every_document_with_python_blocks_is_collected():
    by_source = {}
    for example in EXAMPLES:
        by_source[example.source] = by_source.get(example.source, 0) + 1
    for source in documents():
        with open(os.path.join(ROOT, source), encoding="utf-8") as f:
            fences = sum(line.strip().startswith("```python") for line in f)
        assert by_source.get(source, 0) == fences, source


def test_a_marker_selects_the_launcher_and_other_blocks_are_left_out():
    text = (
        "# page\n\n```bash\nmake test\n```\n\n"
        "<!-- example: horovod np=2 -->\n```python\nimport os\n```\n\n"
        "- item\n\n  <!-- example: multiworker workers=3 -->\n  ```python\n  x = 1\n"
        "  if x:\n      pass\n  ```\n\n```python\nprint(1)\n```\n"
    )
    found = parse(text, "page.md")
    assert [(e.line, e.launcher, e.processes) for e in found] == [
        (8, "horovod", 2),
        (15, "multiworker", 3),
        (21, "python", 1),
    ]
    assert found[1].code == "x = 1\nif x:\n    pass\n"
    assert found[0].id == "page.md:8"


@pytest.mark.parametrize(
    "marker",
    ["<!-- example: mpi np=2 -->", "<!-- example: horovod -->", "<!-- example: python np=2 -->"],
)
def test_a_bad_marker_is_an_error_naming_the_block(marker):
    with pytest.raises(ValueError, match="page.md:2"):
        parse(f"{marker}\n```python\npass\n```\n", "page.md")
