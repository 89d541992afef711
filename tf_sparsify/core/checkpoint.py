"""The exchange state in checkpoints: every replica's rows, keyed by name, checked first.

A :class:`~tf_sparsify.core.state.CompressionState` (residuals, momenta, compressor state,
counters,
diagnostics) is one entry of a ``tf.train.Checkpoint``, written by an
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
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as trackable

from tf_sparsify.core import replica_values

#: state kinds whose every replica holds its own value
PER_REPLICA_KINDS = ("per_replica", "per_replica_mean")
#: keys restored when both sides have them (diagnostics are a record, not training state)
OPTIONAL_KEYS = ("diagnostics", "diagnostics_step")
FORMAT = 1


class Entry(NamedTuple):
    """One variable of a checkpoint entry."""

    #: positional and stable across processes (``residual/3``: the fourth variable's residual)
    key: str
    variable: Any
    #: ``per_replica``, ``per_replica_mean`` (every replica its own), ``replicated``, ``shared``
    kind: str
    #: what it belongs to (a model variable's path), for messages
    about: str = ""


class StateCheckpoint(trackable.Trackable):
    """The checkpoint entry of one exchange state.

    Args:
        entries: the state's :class:`Entry` records (called when saving or restoring, so
            variables made later are included).
        config: the exchange configuration to record and compare (JSON-able).
        rows: ``local -> (first, world)``: the index of this process's first row and the
            number of rows in the job, for a variable with ``local`` rows here.
        built: whether the state's variables exist (a restore before waits for :meth:`build`).
        step: the state's step counter (whose value tells whether gathered rows are current).
        gather: ``local rows -> every row of the job`` where every process joins a checkpoint
            write (``MultiWorkerMirroredStrategy``), or ``None`` where a write is local.
    """

    def __init__(
        self,
        entries: Callable[[], list[Entry]],
        config: Callable[[], dict],
        rows: Callable[[int], tuple[int, int]],
        built: Callable[[], bool],
        step: Callable[[], Any],
        gather: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray] | None],
    ):
        self._entries = entries
        self._config = config
        self._rows = rows
        self._built = built
        self._step = step
        self._gather = gather
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
        return [e.variable for e in self._entries() if e.kind not in PER_REPLICA_KINDS]

    def per_replica_keys(self) -> dict[int, str]:
        """``id(variable) -> key`` of every per-replica variable."""
        return {id(e.variable): e.key for e in self._entries() if e.kind in PER_REPLICA_KINDS}

    def local_rows(self) -> dict[str, np.ndarray]:
        """This process's rows of every per-replica variable."""
        return {e.key: _stacked(e.variable) for e in self._entries() if e.kind in PER_REPLICA_KINDS}

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        """The manifest, a Python state: TF restores those before any tensor, so a
        checkpoint that does not fit is refused before the model's variables are assigned."""
        return {"manifest": self._manifest}

    def describe(self, entries: list[Entry]) -> dict:
        """The manifest of ``entries``: format, exchange configuration, each entry's key,
        kind, shape and dtype."""
        described = [
            {
                "key": e.key,
                "about": e.about,
                "kind": e.kind,
                "shape": list(e.variable.shape),
                "dtype": tf.as_dtype(e.variable.dtype).name,
            }
            for e in entries
        ]
        return {"format": FORMAT, "config": self._config(), "entries": described}

    def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
        entries = self._entries()
        rows, first, world = self._rows_to_save()
        blobs = []
        for key, variable, kind, _ in entries:
            value = rows[key] if kind in PER_REPLICA_KINDS else tf.convert_to_tensor(variable)
            blobs.append(tf.io.serialize_tensor(tf.convert_to_tensor(value)).numpy())
        manifest = {**self.describe(entries), "first_row": first, "world": world}
        texts = [json.dumps(manifest, sort_keys=True).encode()] + blobs
        return {"state": tf.constant(np.array(texts, dtype=object))}

    def _rows_to_save(self) -> tuple[dict[str, np.ndarray], int | None, int | None]:
        """The rows a checkpoint written now holds, the first one's index and the job's row
        count: gathered ones (every row), else this process's."""
        if self._gathered and self._gathered_at == self._current_step():
            rows = self._gathered
        else:
            local = self.local_rows()
            rows = self._gather(local) if local else None
            if rows is None:
                if not local:
                    return {}, None, None
                first, world = self._rows(len(next(iter(local.values()))))
                return local, first, world
        return rows, 0, len(next(iter(rows.values())))

    # -- restoring ------------------------------------------------------------------------------
    def _restore_from_tensors(self, restored_tensors: dict[str, tf.Tensor]):
        texts = list(restored_tensors["state"].numpy())
        if self._built():
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
        if self._built():
            self._check(manifest, self._entries())
        else:
            self._check_config(manifest)

    def _apply(self, texts: list[bytes]) -> None:
        manifest = json.loads(texts[0])
        entries = self._entries()
        self._check(manifest, entries)
        values = {
            e["key"]: tf.io.parse_tensor(blob, tf.as_dtype(e["dtype"])).numpy()
            for blob, e in zip(texts[1:], manifest["entries"], strict=True)
        }
        shared, own, notes = [], {}, []
        for key, variable, kind, _ in entries:
            if key not in values:  # an optional key the checkpoint lacks
                continue
            if kind not in PER_REPLICA_KINDS:
                shared.append((variable, values[key]))
                continue
            rows, note = self._own_rows(key, variable, kind, values[key], manifest)
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
        for key, variable, _, _ in self._entries():
            if key in rows:
                if replica_values.is_per_replica(variable):
                    replica_values.restore(variable, rows[key], key)
                else:
                    variable.assign(rows[key][0])

    def restore_rows(self, rows: dict[str, np.ndarray]) -> None:
        """Assign this process's rows from every row of the job (``{key: [world, ...]}``)."""
        own = {}
        for key, variable, kind, _ in self._entries():
            if key in rows:
                manifest = {"first_row": 0, "world": len(rows[key])}
                value, _ = self._own_rows(key, variable, kind, rows[key], manifest)
                if value is not None:
                    own[key] = value
        self.restore_rows_of_process(own)

    def _check_config(self, manifest: dict) -> None:
        """ValueError naming both configurations when they differ (unless accepted)."""
        if manifest.get("format") != FORMAT:
            raise ValueError(f"Unknown tf_sparsify checkpoint format {manifest.get('format')!r}.")
        config, saved_config = self._config(), manifest["config"]
        if config != saved_config and not self.accept_other_config:
            raise ValueError(
                "This checkpoint holds the exchange state of another configuration: saved "
                f"{json.dumps(saved_config, sort_keys=True)}, this exchange "
                f"{json.dumps(config, sort_keys=True)}. Restore into the same compressor and "
                "options, or set `accept_other_config = True` on the exchange state "
                "(`optimizer.exchange_checkpoint` / `exchange.exchange_checkpoint`) to carry "
                "residuals over where the variables are the same (e.g. another TopK ratio)."
            )

    def _check(self, manifest: dict, entries: list[Entry]) -> None:
        """ValueError naming what differs between the checkpoint and this state."""
        self._check_config(manifest)
        saved = {
            e["key"]: (e["kind"], e["shape"], e["dtype"])
            for e in manifest["entries"]
            if e["key"] not in OPTIONAL_KEYS
        }
        current = {
            e.key: (e.kind, list(e.variable.shape), tf.as_dtype(e.variable.dtype).name)
            for e in entries
            if e.key not in OPTIONAL_KEYS
        }
        if saved != current:
            saved_about = {e["key"]: e.get("about", "") for e in manifest["entries"]}
            about = {e.key: e.about for e in entries}

            def named(keys, about) -> list[str]:
                return [f"{k} ({about[k]})" if about[k] else k for k in sorted(keys)]

            missing = named(set(current) - set(saved), about)
            extra = named(set(saved) - set(current), saved_about)
            changed = {
                f"{k} ({about[k]})": {"saved": saved[k], "here": current[k]}
                for k in sorted(set(saved) & set(current))
                if saved[k] != current[k]
            }
            raise ValueError(
                "This checkpoint's exchange state does not fit this exchange (nothing was "
                f"restored): not in the checkpoint {missing}; in the checkpoint, not here "
                f"{extra}; different (kind, shape, dtype) {changed}. Saved configuration "
                f"{json.dumps(manifest['config'], sort_keys=True)}, this exchange "
                f"{json.dumps(self._config(), sort_keys=True)}."
            )

    def _own_rows(
        self, key: str, variable, kind: str, value: np.ndarray, manifest: dict
    ) -> tuple[np.ndarray | None, str]:
        """This process's rows of a per-replica variable, and a note when not exact."""
        local = replica_values.replica_count(variable)
        first, world = self._rows(local)
        saved_first, saved_world = manifest["first_row"], manifest["world"]
        complete = saved_first == 0 and len(value) == saved_world
        if complete:
            self.restored_rows[key] = value
        if (
            saved_world == world
            and saved_first <= first
            and first + local <= saved_first + len(value)
        ):
            start = first - saved_first
            return value[start : start + local], ""
        if saved_world == world or not complete:
            return None, (
                f"the checkpoint holds rows {saved_first}..{saved_first + len(value) - 1} of "
                f"{saved_world}, not this process's rows {first}..{first + local - 1}: their "
                "error memory starts from zero (under Horovod, call "
                "tf_sparsify.horovod.gather_error_memory on every rank before rank 0 saves)"
            )
        total = value.sum(0) if kind == "per_replica" else value.mean(0)
        share = total / world if kind == "per_replica" else total
        rows = np.stack([share] * local).astype(value.dtype)
        return rows, (
            f"the checkpoint was written by a job of {saved_world} rows and this one has "
            f"{world}: each variable's total is conserved (summed, then split evenly), not each "
            "row's value"
        )

    def _current_step(self) -> int | None:
        step = self._step()
        return None if step is None else int(tf.convert_to_tensor(step).numpy())


class _Manifest(tf.train.experimental.PythonState):
    """The manifest of an :class:`StateCheckpoint` as a Python state of its own: TF
    deserializes Python states before it assigns any tensor of the checkpoint, so a restore
    that does not fit fails before the model, the inner optimizer or the wrapper changes."""

    def __init__(self, owner: StateCheckpoint):
        self._owner = owner

    def serialize(self) -> str:
        return json.dumps(self._owner.describe(self._owner._entries()), sort_keys=True)

    def deserialize(self, string_value) -> None:
        self._owner.check_manifest(json.loads(string_value))


def _stacked(variable) -> np.ndarray:
    """This process's rows of ``variable``: its replicas' values, or its value as one row."""
    value = replica_values.saved_value(variable)
    return value if replica_values.is_per_replica(variable) else value[None]
