"""Elastic Horovod (``hvd.elastic.run``) with per-rank error memory.

:class:`ElasticState` is the state object of an elastic job whose gradients go through a
tf_sparsify :class:`~tf_sparsify.horovod.DistributedOptimizer` or
:class:`~tf_sparsify.horovod.GradientExchange`::

    state = th.ElasticState(model.variables, optimizer, epoch=0)   # or the exchange

    @tf_sparsify.horovod.elastic.run
    def train(state):
        step = tf.function(train_step)   # traced anew after every reset: the size changed
        ...
        state.commit()

What happens to the error memory (residuals, momenta), which every rank keeps for itself:

- ``commit()`` saves this rank's rows locally and gathers every rank's rows (one
  ``allgather_object``), so every rank knows the whole job's error memory as committed.
- After a failure, ``restore()`` puts back the committed values (model, optimizer, this rank's
  rows), as Horovod's own states do.
- ``sync()`` (after workers left or joined) broadcasts the model and the shared optimizer and
  exchange state from rank 0. Each surviving rank keeps its own rows. The rows of ranks that
  left are not lost: their committed sum is split evenly over the surviving ranks and added to
  their residuals, so the total error mass of the job is conserved (as of the last commit). A
  rank that joins starts from zero. The ranks compare their plans again before the next
  exchange.
"""

from __future__ import annotations

import os
import socket
import warnings

import numpy as np
import tensorflow as tf
from horovod.common.elastic import ObjectState
from horovod.common.exceptions import HorovodInternalError

from tf_sparsify.horovod._hvd import hvd
from tf_sparsify.horovod.broadcast import broadcast_variables
from tf_sparsify.horovod.error_memory import _holder


def run(func):
    """``hvd.elastic.run`` that also recognizes a failed tf_sparsify exchange (Horovod's
    grouped collectives, whose errors Horovod's own wrapper does not know) as a lost worker."""

    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as error:
            if "Horovod" not in str(error):
                raise
            raise HorovodInternalError(error) from error

    return hvd.elastic.run(wrapper)


class ElasticState(ObjectState):
    """The elastic state of ``variables`` (the model's) and a tf_sparsify optimizer or
    exchange (``holder``); keyword arguments are synced Python attributes, as in Horovod's
    ``ObjectState`` (``epoch=0``, ``batch=0``, ...)."""

    def __init__(self, variables, holder, **kwargs):
        self._holder = _holder(holder)
        self._checkpoint = self._holder.exchange_checkpoint
        self._model_variables = list(variables)
        #: this process, as the job's other ranks know it across resets
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self._values: list[np.ndarray] = []
        self._own: dict[str, np.ndarray] = {}
        self._committed: dict[str, dict[str, np.ndarray]] = {}
        self._save_local()
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)

    def _shared(self) -> list:
        return self._model_variables + self._checkpoint.shared_variables()

    def _save_local(self) -> None:
        self._values = [np.array(v.numpy()) for v in self._shared()]
        self._own = self._checkpoint.local_rows()

    def save(self) -> None:
        """This rank's values locally, and every rank's error memory (a collective)."""
        self._save_local()
        everyone = hvd.allgather_object((self.worker, self._own), name="tf_sparsify_elastic")
        self._committed = dict(everyone)
        super().save()

    def restore(self) -> None:
        for variable, value in zip(self._shared(), self._values, strict=True):
            variable.assign(value)
        self._checkpoint.restore_rows_of_process(self._own)
        super().restore()

    def sync(self) -> None:
        """Rank 0's model and shared state; each rank's own error memory, plus an even share of
        what ranks that left held; the plan check armed again on every rank."""
        transport = self._holder.transport
        if transport.checked is not None:
            transport.checked.assign(False)
        broadcast_variables(self._shared(), root_rank=0)
        present = hvd.allgather_object(self.worker, name="tf_sparsify_elastic_workers")
        if self.worker in self._committed:
            self._take_share_of_the_lost(present)
        super().sync()
        self.save()

    def _take_share_of_the_lost(self, present: list[str]) -> None:
        lost = [w for w in self._committed if w not in present]
        if not lost:
            return
        survivors = [w for w in present if w in self._committed]
        rows = {}
        for key, own in self._own.items():
            gone = sum(self._committed[w][key] for w in lost)
            rows[key] = (own + gone / len(survivors)).astype(own.dtype)
        self._checkpoint.restore_rows_of_process(rows)
        warnings.warn(
            f"tf_sparsify: {len(lost)} rank(s) left the job; their committed error memory is "
            f"split evenly over the {len(survivors)} remaining rank(s) that held some "
            "(the job's total is conserved as of the last commit).",
            stacklevel=2,
        )
