"""What a checkpoint of the state core records besides the values, and the rules that read it:
the manifest (format, configuration, each entry's key, kind, shape and dtype, which rows it
holds), the checks that refuse a checkpoint that does not fit, and which rows each process
restores (conserving each variable's total when the job changed size)."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tf_sparsify.compressors.base import deserialize, serialize
from tf_sparsify.core.state_kinds import StateKind
from tf_sparsify.core.step_records import RECORD_KEYS

FORMAT = 1


class Entry(NamedTuple):
    """One variable of a checkpoint entry."""

    #: positional and stable across processes (``residual/3``: the fourth variable's residual)
    key: str
    variable: Any
    kind: StateKind
    #: what it belongs to (a model variable's path), for messages
    about: str = ""


def describe(entries: list[Entry], config: dict) -> dict:
    """The manifest of ``entries``: format, configuration, each entry's key, kind, shape and
    dtype."""
    described = [
        {
            "key": e.key,
            "about": e.about,
            "kind": StateKind(e.kind).value,
            "shape": list(e.variable.shape),
            "dtype": tf.as_dtype(e.variable.dtype).name,
        }
        for e in entries
    ]
    return {"format": FORMAT, "config": config, "entries": described}


def check_config(manifest: dict, config: dict, accept_other: bool) -> None:
    """ValueError naming both configurations when they differ (unless ``accept_other``)."""
    if manifest.get("format") != FORMAT:
        raise ValueError(f"Unknown tf_sparsify checkpoint format {manifest.get('format')!r}.")
    saved_config = manifest["config"]
    if without_decisions(config) != without_decisions(saved_config) and not accept_other:
        raise ValueError(
            "This checkpoint holds the exchange state of another configuration: saved "
            f"{json.dumps(saved_config, sort_keys=True)}, this exchange "
            f"{json.dumps(config, sort_keys=True)}. Restore into the same compressor and "
            "options, or set `accept_other_config = True` on the exchange state "
            "(`optimizer.exchange_checkpoint` / `exchange.exchange_checkpoint`) to carry "
            "residuals over where the variables are the same (e.g. another TopK ratio)."
        )


def without_decisions(config: dict) -> dict:
    """A recorded configuration without its compressor's decisions
    (:meth:`~tf_sparsify.compressors.base.Compressor.without_decisions`)."""
    compressor = deserialize(config["compressor"]).without_decisions()
    return {**config, "compressor": json.loads(json.dumps(serialize(compressor), default=str))}


def check_entries(manifest: dict, entries: list[Entry], config: dict) -> None:
    """ValueError naming what differs between the checkpoint's entries and ``entries``."""
    saved = {
        e["key"]: (e["kind"], e["shape"], e["dtype"])
        for e in manifest["entries"]
        if e["key"] not in RECORD_KEYS  # restored when both sides have them
    }
    current = {
        e.key: (StateKind(e.kind).value, list(e.variable.shape), tf.as_dtype(e.variable.dtype).name)
        for e in entries
        if e.key not in RECORD_KEYS
    }
    if saved == current:
        return
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
        f"{json.dumps(config, sort_keys=True)}."
    )


def rows_of_process(
    kind: StateKind, value: np.ndarray, local: int, first: int, world: int, manifest: dict
) -> tuple[np.ndarray | None, str]:
    """This process's ``local`` rows (from row ``first`` of ``world``) of a per-replica
    variable saved as ``value`` (rows ``first_row`` on of the manifest's ``world``), and a
    note when they are not the saved rows themselves: rows of another job's size conserve
    the variable's total (:meth:`StateKind.resized`); rows the checkpoint lacks are ``None``."""
    saved_first, saved_world = manifest["first_row"], manifest["world"]
    if saved_world == world and saved_first <= first and first + local <= saved_first + len(value):
        start = first - saved_first
        return value[start : start + local], ""
    if saved_world == world or not is_complete(value, manifest):
        return None, (
            f"the checkpoint holds rows {saved_first}..{saved_first + len(value) - 1} of "
            f"{saved_world}, not this process's rows {first}..{first + local - 1}: their "
            "error memory starts from zero (under Horovod, call "
            "tf_sparsify.horovod.gather_error_memory on every rank before rank 0 saves)"
        )
    return StateKind(kind).resized(value, world)[:local], (
        f"the checkpoint was written by a job of {saved_world} rows and this one has "
        f"{world}: each variable's total is conserved (summed, then split evenly), not each "
        "row's value"
    )


def is_complete(value: np.ndarray, manifest: dict) -> bool:
    """Whether ``value`` holds every row of the job that saved it."""
    return manifest["first_row"] == 0 and len(value) == manifest["world"]
