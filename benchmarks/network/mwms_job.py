"""Start the MultiWorkerMirroredStrategy workers of one job (run inside the job's namespace).

    python -m benchmarks.network.mwms_job --workers 2 --timeout 600 -- WORKER ARGS...

Runs ``python -m benchmarks.network.worker WORKER ARGS`` once per worker through
:func:`tf_sparsify.distribute.run_local_workers`, so the free ports it picks and the workers'
``TF_CONFIG`` addresses are those of the namespace this process runs in. Exits 1 with the
workers' output when one fails or the time runs out (every worker killed first).
"""

from __future__ import annotations

import argparse
import os
import sys

from tf_sparsify.distribute import run_local_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True, help="seconds for the whole job")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])
    worker_args = argv[split + 1 :]
    path = os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x)
    try:
        run_local_workers(
            ["-m", "benchmarks.network.worker", *worker_args],
            args.workers,
            timeout=args.timeout,
            env={"PYTHONPATH": path},
        )
    except (RuntimeError, TimeoutError) as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
