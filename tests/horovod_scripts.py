"""Runs several Python scripts one after another in one ``horovodrun`` launch, each as
``__main__`` in its own folder (a launch costs ~15 s of start-up on 2 cores):
``horovodrun -np 2 --gloo python tests/horovod_scripts.py A/example.py B/example.py``. Every rank
prints ``SCRIPT {path} {exit status}`` after each (a traceback before a non-zero status).
"""

from __future__ import annotations

import sys

from script_runner import run_script

MARKER = "SCRIPT "


def main(scripts: list[str]) -> None:
    for script in scripts:
        code = run_script(script)
        sys.stderr.flush()
        print(f"{MARKER}{script} {code}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
