"""tf.distribute front end: delayed updates, IAG, simulated workers, local multi-worker runs.

- :class:`ServerOptimizer`: a SparsifiedOptimizer with a server stage between exchange and
  update, under any strategy (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``) or with
  ``P`` workers simulated on one device.
- Servers: :class:`DelayedGradients` (fixed, random or per-replica delays) and :class:`IAG`.
- :class:`SimulatedWorkers`: ``fit`` with batches split over simulated workers.
- :func:`run_local_workers`: ``MultiWorkerMirroredStrategy`` workers as local processes.
- :func:`enable_multi_worker_fit`: Keras 3's ``model.fit`` under ``MultiWorkerMirroredStrategy``
  for plain Keras optimizers too (models with a SparsifiedOptimizer have it already).
"""

from tf_sparsify.distribute.multiworker import free_ports, run_local_workers, tf_config
from tf_sparsify.distribute.optimizer import ServerOptimizer
from tf_sparsify.distribute.servers import IAG, DelayedGradients, Server
from tf_sparsify.distribute.simulated import SimulatedWorkerCollective, SimulatedWorkers
from tf_sparsify.keras.multi_worker import enable_multi_worker_fit

__all__ = [
    "IAG",
    "DelayedGradients",
    "Server",
    "ServerOptimizer",
    "SimulatedWorkerCollective",
    "SimulatedWorkers",
    "enable_multi_worker_fit",
    "free_ports",
    "run_local_workers",
    "tf_config",
]
