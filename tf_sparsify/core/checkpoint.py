"""The exchange state in checkpoints: every replica's rows, keyed by name, checked first.

A :class:`~tf_sparsify.core.state.CompressionState` (residuals, momenta, compressor state,
counters, diagnostics) is one entry of a ``tf.train.Checkpoint``, written by an
:class:`StateCheckpoint`: a string tensor holding a manifest (the exchange configuration,
which rows the checkpoint holds, each variable's key, kind, shape and dtype) and the serialized
values. One entry, because a restore must be all or nothing: the manifest is compared with this
process's state before any value is assigned, and a different configuration or different
variables are named instead of restored into the wrong buffers.

Rows. A per-replica variable (residual, momentum, diagnostics) is saved as the stack of its
rows: under tf.distribute, the replicas this process holds; under Horovod, this rank's own row,
or every rank's once :func:`tf_sparsify.horovod.gather_error_memory` has gathered them on every
rank (then a checkpoint written by rank 0 alone holds the whole job's error memory). Each
replica or rank restores its own row, so restore-then-continue equals not stopping.

When the checkpoint holds every row of a job of another size, the total is conserved: the rows
are summed (averaged, for a mean) and split evenly over this job's rows, with one warning. A
checkpoint without this process's rows (rank 0's alone, restored on rank 1) restores nothing for
them and warns: that rank's error memory starts from zero.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Protocol

import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as trackable

from tf_sparsify.core import replica_values
from tf_sparsify.core.checkpoint_manifest import (
    Entry,
    check_config,
    check_entries,
    describe,
    is_complete,
    rows_of_process,
)
from tf_sparsify.core.state_kinds import StateKind


class Source(Protocol):
    """What a checkpoint entry reads of its state core (:class:`~tf_sparsify.core.state.
    CompressionState`)."""

    #: whether the state's variables exist (a restore before waits for ``build``)
    built: bool
    #: the step counter (its value tells whether gathered rows are current)
    step: Any
    #: where this process's rows sit in the job, and how a write gathers every row
    transport: Any

    def saved_entries(self) -> list[Entry]:
        """Every variable to save (called when saving or restoring, so later ones count)."""

    def config(self) -> dict:
        """The configuration to record and compare (JSON values)."""

    def adopt_decisions(self, saved_config: dict) -> None:
        """Take the decisions of an adaptive compressor that ``saved_config`` records."""


class StateCheckpoint(trackable.Trackable):
    """The checkpoint entry of one state core (its ``source``: see :class:`Source`)."""

    def __init__(self, source: Source):
        self._source = source
        self._manifest = _Manifest(self)
        self._gathered: dict[str, np.ndarray] = {}
        self._gathered_at: int | None = None
        self._pending: list[bytes] | None = None
        #: the job's rows of each per-replica variable from the last restore of a complete
        #: checkpoint (for a restore on one rank that is then broadcast)
        self.restored_rows: dict[str, np.ndarray] = {}
        #: restore residuals saved under another compressor configuration (same variables)
        self.accept_other_config = False

    # -- saving ---------------------------------------------------------------------------------
    def gathered(self, rows: dict[str, np.ndarray]) -> None:
        """Use these whole-job rows (from every rank) when saving at the current step."""
        self._gathered = dict(rows)
        self._gathered_at = self._current_step()

    def shared_variables(self) -> list:
        """The variables every replica holds alike (counters, compressor state, a Keras
        optimizer's own)."""
        return [e.variable for e in self._entries(per_replica=False)]

    def per_replica_keys(self) -> dict[int, str]:
        """``id(variable) -> key`` of every per-replica variable."""
        return {id(e.variable): e.key for e in self._entries(per_replica=True)}

    def local_rows(self) -> dict[str, np.ndarray]:
        """This process's rows of every per-replica variable."""
        return {e.key: _stacked(e.variable) for e in self._entries(per_replica=True)}

    def _entries(self, per_replica: bool) -> list[Entry]:
        """The saved entries whose kind is (or is not) held per replica."""
        entries = self._source.saved_entries()
        return [e for e in entries if StateKind(e.kind).per_replica == per_replica]

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        """The manifest, a Python state: TF restores those before any tensor, so a
        checkpoint that does not fit is refused before the model's variables are assigned."""
        return {"manifest": self._manifest}

    def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
        entries = self._source.saved_entries()
        rows, first, world = self._rows_to_save()
        blobs = []
        for key, variable, kind, _ in entries:
            value = rows[key] if StateKind(kind).per_replica else tf.convert_to_tensor(variable)
            blobs.append(tf.io.serialize_tensor(tf.convert_to_tensor(value)).numpy())
        manifest = {**describe(entries, self._source.config()), "first_row": first, "world": world}
        texts = [json.dumps(manifest, sort_keys=True).encode()] + blobs
        return {"state": tf.constant(np.array(texts, dtype=object))}

    def _rows_to_save(self) -> tuple[dict[str, np.ndarray], int | None, int | None]:
        """The rows a checkpoint written now holds, the first one's index and the job's row
        count: gathered ones (every row), else this process's."""
        if self._gathered and self._gathered_at == self._current_step():
            rows = self._gathered
        else:
            local = self.local_rows()
            rows = self._source.transport.gather_rows_when_saving(local) if local else None
            if rows is None:
                if not local:
                    return {}, None, None
                first, world = self._source.transport.checkpoint_rows(
                    len(next(iter(local.values())))
                )
                return local, first, world
        return rows, 0, len(next(iter(rows.values())))

    # -- restoring ------------------------------------------------------------------------------
    def _restore_from_tensors(self, restored_tensors: dict[str, tf.Tensor]):
        texts = list(restored_tensors["state"].numpy())
        if self._source.built:
            self._apply(texts)
        else:
            self._pending = texts
        return tf.no_op()

    def build(self) -> None:
        """Apply a restore that came before the state's variables existed (eagerly, also when
        the state is built inside a traced train step)."""
        if self._pending is not None:
            texts, self._pending = self._pending, None
            with tf.init_scope():
                self._apply(texts)

    def check_manifest(self, manifest: dict) -> None:
        """Refuse a checkpoint whose manifest does not fit this state (before anything is
        restored); before the state is built, only its configuration can be compared."""
        check_config(manifest, self._source.config(), self.accept_other_config)
        if self._source.built:
            check_entries(manifest, self._source.saved_entries(), self._source.config())
        self._source.adopt_decisions(manifest["config"])

    def _apply(self, texts: list[bytes]) -> None:
        manifest = json.loads(texts[0])
        entries = self._source.saved_entries()
        self.check_manifest(manifest)
        values = {
            e["key"]: tf.io.parse_tensor(blob, tf.as_dtype(e["dtype"])).numpy()
            for blob, e in zip(texts[1:], manifest["entries"], strict=True)
        }
        shared, own, notes = [], {}, []
        for key, variable, kind, _ in entries:
            if key not in values:  # an optional key the checkpoint lacks
                continue
            if not StateKind(kind).per_replica:
                shared.append((variable, values[key]))
                continue
            rows, note = self._own_rows(variable, kind, values[key], manifest)
            if is_complete(values[key], manifest):
                self.restored_rows[key] = values[key]
            if note:
                notes.append(note)
            if rows is not None:
                own[key] = rows
        for variable, value in shared:  # everything checked: now assign
            variable.assign(value)
        self.restore_rows_of_process(own)
        if notes:
            warnings.warn(
                "tf_sparsify: restoring the exchange state: " + "; ".join(sorted(set(notes))),
                stacklevel=4,
            )

    def restore_rows_of_process(self, rows: dict[str, np.ndarray]) -> None:
        """Assign this process's rows (``{key: [local, ...]}``, as :meth:`local_rows` gives)."""
        for key, variable, _, _ in self._source.saved_entries():
            if key in rows:
                if replica_values.is_per_replica(variable):
                    replica_values.restore(variable, rows[key], key)
                else:
                    variable.assign(rows[key][0])

    def restore_rows(self, rows: dict[str, np.ndarray]) -> None:
        """Assign this process's rows from every row of the job (``{key: [world, ...]}``)."""
        own = {}
        for key, variable, kind, _ in self._source.saved_entries():
            if key in rows:
                manifest = {"first_row": 0, "world": len(rows[key])}
                value, _ = self._own_rows(variable, kind, rows[key], manifest)
                if value is not None:
                    own[key] = value
        self.restore_rows_of_process(own)

    def _own_rows(
        self, variable, kind: StateKind, value: np.ndarray, manifest: dict
    ) -> tuple[np.ndarray | None, str]:
        """This process's rows of a per-replica variable, and a note when not exact."""
        local = replica_values.replica_count(variable)
        first, world = self._source.transport.checkpoint_rows(local)
        return rows_of_process(kind, value, local, first, world, manifest)

    def _current_step(self) -> int | None:
        step = self._source.step
        return None if step is None else int(tf.convert_to_tensor(step).numpy())


class _Manifest(tf.train.experimental.PythonState):
    """The manifest of an :class:`StateCheckpoint` as a Python state of its own: TF
    deserializes Python states before it assigns any tensor of the checkpoint, so a restore
    that does not fit fails before the model, the inner optimizer or the wrapper changes."""

    def __init__(self, owner: StateCheckpoint):
        self._owner = owner

    def serialize(self) -> str:
        owner = self._owner
        return json.dumps(
            describe(owner._source.saved_entries(), owner._source.config()), sort_keys=True
        )

    def deserialize(self, string_value) -> None:
        self._owner.check_manifest(json.loads(string_value))


def _stacked(variable) -> np.ndarray:
    """This process's rows of ``variable``: its replicas' values, or its value as one row."""
    value = replica_values.saved_value(variable)
    return value if replica_values.is_per_replica(variable) else value[None]
