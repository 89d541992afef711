"""Runs a Python script as ``python script`` would, inside an interpreter already running."""

from __future__ import annotations

import os
import runpy
import sys
import traceback


def run_script(script: str) -> int:
    """Run ``script`` as ``__main__`` in its folder (argv and ``sys.path[0]`` as ``python
    script`` sets them); its exit status, 1 after an uncaught exception (traceback on stderr)."""
    folder = os.path.dirname(os.path.abspath(script))
    os.chdir(folder)
    sys.argv = [script]
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
