"""Give each process of a benchmark job its own share of the machine's cores.

Ranks on one host model ranks on separate machines better when they do not share cores: with
shared cores a rank that waits at a collective lends its core to the other rank, so the
compute-only probe runs faster than any synchronous step can, and every synchronous step waits
for whichever rank the scheduler slowed. The job launcher sets ``PIN_ENV`` to "1"; each process
then calls :func:`pin_to_rank_cores` before TensorFlow starts its thread pools (the threads it
starts later inherit the mask).
"""

from __future__ import annotations

import json
import os

PIN_ENV = "TFS_BENCH_PIN_CORES"


def local_rank() -> tuple[int, int] | None:
    """``(rank, ranks)`` on this host, from Horovod's launcher or ``TF_CONFIG``; else None."""
    if "HOROVOD_LOCAL_RANK" in os.environ and "HOROVOD_LOCAL_SIZE" in os.environ:
        return int(os.environ["HOROVOD_LOCAL_RANK"]), int(os.environ["HOROVOD_LOCAL_SIZE"])
    if "TF_CONFIG" in os.environ:
        config = json.loads(os.environ["TF_CONFIG"])
        return int(config["task"]["index"]), len(config["cluster"]["worker"])
    return None


def rank_cores(rank: int, ranks: int, cores: list[int]) -> list[int] | None:
    """Rank ``rank``'s equal, disjoint share of ``cores``; None when there are fewer cores
    than ranks (then nothing is pinned)."""
    if not 0 <= rank < ranks:
        raise ValueError(f"rank must be in [0, {ranks}), got {rank}")
    share = len(cores) // ranks
    return sorted(cores)[rank * share : (rank + 1) * share] if share else None


def pin_to_rank_cores() -> list[int] | None:
    """When ``PIN_ENV`` is "1" and the rank is known, restrict this process to its share of
    the cores it may use and return them; else change nothing and return None."""
    where = local_rank()
    if os.environ.get(PIN_ENV) != "1" or where is None:
        return None
    cores = rank_cores(*where, sorted(os.sched_getaffinity(0)))
    if cores is not None:
        os.sched_setaffinity(0, cores)
    return cores
