"""The README's main job runs end to end (shortened) and writes its table and PNG."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT


def test_digits_demo_prints_table_and_writes_png(tmp_path):
    png = tmp_path / "demo.png"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "digits_demo.py"),
            "--epochs=2",
            "--compressors=dense,topk1,qsgd4",
            "--verbose=0",
            f"--out={png}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("  ")[0]: line.split() for line in proc.stdout.splitlines()}
    topk = rows["TopK 1% + EF"]
    assert float(topk[-2].rstrip("x")) > 40  # compression ratio of TopK 1% on this MLP
    assert 0.5 < float(topk[-4]) <= 1.0  # test accuracy after 2 epochs
    assert float(rows["QSGD s=4"][-2].rstrip("x")) > 3.9
    assert png.stat().st_size > 10_000


def test_demo_rejects_unknown_compressor():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "digits_demo.py"), "--compressors=zip"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 2 and "unknown compressors ['zip']" in proc.stderr
