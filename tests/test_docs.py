"""The documentation site builds with ``mkdocs build --strict`` (what ``make docs`` runs): a
broken link, a page missing from the nav or a docstring the API reference cannot read fails."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.script_runner import ROOT


def test_the_site_builds_without_warnings(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "WARNING" not in log, log[-6000:]
    assert (tmp_path / "reference" / "keras" / "index.html").is_file()
    assert "SparsifiedOptimizer" in (tmp_path / "reference" / "keras" / "index.html").read_text()
