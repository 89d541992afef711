"""tf.distribute front end: delayed updates, IAG, simulated workers, local multi-worker runs.

- :class:`ServerOptimizer`: a SparsifiedOptimizer with a server stage between exchange and
  update, under any strategy (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``) or with
  ``P`` workers simulated on one device.
- Servers: :class:`DelayedGradients` (fixed, random or per-replica delays) and :class:`IAG`.
- :class:`SimulatedWorkers`: ``fit`` with batches split over simulated workers.
- :func:`run_local_workers`: ``MultiWorkerMirroredStrategy`` workers as local processes.
"""

from tf_sparsify.distribute.multiworker import free_ports, run_local_workers, tf_config
from tf_sparsify.distribute.optimizer import ServerOptimizer
from tf_sparsify.distribute.servers import IAG, DelayedGradients, Server
from tf_sparsify.distribute.simulated import SimulatedWorker, SimulatedWorkers

__all__ = [
    "IAG",
    "DelayedGradients",
    "Server",
    "ServerOptimizer",
    "SimulatedWorker",
    "SimulatedWorkers",
    "free_ports",
    "run_local_workers",
    "tf_config",
]
