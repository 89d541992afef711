"""How tensors travel between replicas: the collectives. They move tensors and know nothing
else (no plan, no pipeline, no state): the interface (:mod:`~tf_sparsify.collectives.base`),
local ones, tf.distribute's replica context, the byte view on the wire, and the layouts a step's
gradients take (the variables, or the hierarchical exchange's shards). Horovod's collective
lives with its front end (:mod:`tf_sparsify.horovod`)."""

from tf_sparsify.collectives.base import Collective
from tf_sparsify.collectives.layout import IDENTITY, Layout
from tf_sparsify.collectives.local import LocalCollective, SimulatedWorkerCollective
from tf_sparsify.collectives.replica_context import ReplicaContextCollective, current_collective

__all__ = [
    "IDENTITY",
    "Collective",
    "Layout",
    "LocalCollective",
    "ReplicaContextCollective",
    "SimulatedWorkerCollective",
    "current_collective",
]
