"""Runs several workers of this folder in one ``horovodrun`` launch, one after another, e.g.
``suite.py exact mismatch`` (a launch costs ~15 s of start-up on 2 cores). Every worker's
``RESULT`` lines name it (``worker``); the exit status is 1 when any worker had a failed check.
"""

from __future__ import annotations

import importlib
import sys

import common


def main(workers: list[str]) -> None:
    status = 0
    for name in workers:
        common.WORKER = name
        try:
            importlib.import_module(name).main()
        except SystemExit as stop:
            status = max(status, 1 if stop.code else 0)
    sys.exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
