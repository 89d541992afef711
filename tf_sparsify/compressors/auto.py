"""``Auto``: each unit sent with its own setting, from the least compression to the most.

The settings are dense (fp32), a 16-bit cast (FP16 or BF16), then TopK at each of a few
densities, largest first; every one runs with error feedback, so a unit keeps one residual
whatever it is sent with, and a change of setting carries it over (dense and the casts send it
whole). ``levels`` holds the setting of each compressed unit, in variable order. Which levels a
step uses is static (part of the traced step and of the plan every rank checks); they change
between steps by a new ``Auto`` (:meth:`Auto.with_levels`), which the tuner
(:class:`tf_sparsify.keras.AutoCompression`) chooses from measurements. ``memory`` holds what
the tuner carries from one decision to the next (each unit's last gradient norm, the link it
measured, how many decisions it made): like the levels it is a decision, restored with a
checkpoint, so a resumed job decides as the one that did not stop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from tf_sparsify.common.checks import check_int
from tf_sparsify.compressors.base import Compressor, check_ratio
from tf_sparsify.compressors.dense import BF16, FP16, Identity
from tf_sparsify.compressors.topk import TopK

#: TopK densities Auto may use unless told otherwise (largest first)
DENSITIES = (0.01, 0.001)
_HALVES = {"fp16": FP16, "bf16": BF16}


class Auto(Compressor):
    """Sends compressed unit ``i`` with ``settings[levels[i]]`` (all dense while ``levels`` is
    None).

    Args:
        densities: TopK densities in (0, 1], each once; sorted largest first.
        half: the 16-bit cast, ``"fp16"`` or ``"bf16"``.
        levels: one index into :attr:`settings` per compressed unit, or None.
        memory: the tuner's memory (JSON values), or None: ``norms`` (each compressed unit's
            mean gradient norm over the last interval), ``link`` (the link measured, as
            ``LinkMeasurement`` fields), ``decided`` (decisions made).
    """

    unbiased = False  # error feedback is on unless the user turns it off
    runs_under_xla = True  # every setting does

    def __init__(
        self,
        densities: Sequence[float] = DENSITIES,
        half: str = "fp16",
        levels: Sequence[int] | None = None,
        memory: Mapping[str, Any] | None = None,
    ):
        if isinstance(densities, str | bytes) or not isinstance(densities, Sequence):
            raise ValueError(
                f"`densities` must be a sequence of TopK densities; received {densities!r}"
            )
        values = sorted((check_ratio(d) for d in densities), reverse=True)
        if not values or len(set(values)) != len(values):
            raise ValueError(
                f"`densities` must hold at least one density, each once; received {densities!r}"
            )
        if half not in _HALVES:
            raise ValueError(f"`half` must be one of {sorted(_HALVES)}; received half={half!r}")
        self.densities = tuple(values)
        self.half = half
        self.settings: tuple[Compressor, ...] = (
            Identity(),
            _HALVES[half](),
            *(TopK(ratio=d) for d in self.densities),
        )
        self.levels = None if levels is None else self._check_levels(levels)
        self.memory = None if memory is None else _check_memory(memory)

    @property
    def names(self) -> tuple[str, ...]:
        """A short name per setting: ``dense``, ``fp16``, ``topk1%``, ..."""
        return ("dense", self.half, *(f"topk{100 * d:g}%" for d in self.densities))

    def _check_levels(self, levels: Sequence[int]) -> tuple[int, ...]:
        if isinstance(levels, str | bytes) or not isinstance(levels, Sequence):
            raise ValueError(f"`levels` must be a sequence of ints; received levels={levels!r}")
        top = len(self.settings) - 1
        return tuple(check_int(f"levels[{i}]", lv, 0, top) for i, lv in enumerate(levels))

    def with_levels(self, levels: Sequence[int] | None) -> Auto:
        """The same settings and memory, sent at ``levels``."""
        return Auto(self.densities, self.half, levels, self.memory)

    def with_memory(self, memory: Mapping[str, Any] | None) -> Auto:
        """The same settings and levels, with the tuner's ``memory``."""
        return Auto(self.densities, self.half, self.levels, memory)

    def without_decisions(self) -> Auto:
        return Auto(self.densities, self.half)

    def for_unit(self, position: int, count: int) -> Compressor:
        """The setting of compressed unit ``position`` of ``count``; ValueError when ``levels``
        does not hold one level per unit."""
        if self.levels is None:
            return self.settings[0]
        if len(self.levels) != count:
            raise ValueError(
                f"`levels` must hold one level per compressed unit ({count}); received "
                f"{len(self.levels)}: levels={list(self.levels)}"
            )
        return self.settings[self.levels[position]]

    def contraction(self, num_elements: int) -> float | None:
        """The weakest of its settings' (TopK at the smallest density)."""
        return min(s.contraction(num_elements) for s in self.settings)

    def start(self, *args: Any, **kwargs: Any):
        raise TypeError(
            "Auto does not send a tensor itself: the plan gives each unit one of its settings "
            "(Auto.for_unit); use it through a pipeline or an optimizer"
        )

    def get_config(self) -> dict[str, Any]:
        return {
            "densities": list(self.densities),
            "half": self.half,
            "levels": None if self.levels is None else list(self.levels),
            "memory": self.memory,
        }


_LINK_FIELDS = {"workers", "payload_bytes", "seconds", "cpu_seconds"}


def _check_memory(memory: Mapping[str, Any]) -> dict[str, Any]:
    """``memory`` as plain JSON values; ValueError naming what does not fit."""
    if not isinstance(memory, Mapping) or not set(memory) <= {"norms", "link", "decided"}:
        raise ValueError(
            "`memory` must be a mapping of `norms`, `link` and `decided`; received "
            f"memory={memory!r}"
        )
    norms = memory.get("norms")
    if norms is not None and (
        isinstance(norms, str | bytes)
        or not isinstance(norms, Sequence)
        or not all(isinstance(n, int | float) and math.isfinite(n) and n >= 0 for n in norms)
    ):
        raise ValueError(f"`memory['norms']` must be finite norms >= 0; received {norms!r}")
    link = memory.get("link")
    if link is not None and (
        not isinstance(link, Mapping)
        or not {"workers", "payload_bytes", "seconds"} <= set(link)
        or not set(link) <= _LINK_FIELDS
    ):
        raise ValueError(
            f"`memory['link']` must hold a LinkMeasurement's fields {sorted(_LINK_FIELDS)}; "
            f"received {link!r}"
        )
    decided = check_int("memory['decided']", memory.get("decided", 0), 0)
    return {
        "norms": None if norms is None else [float(n) for n in norms],
        "link": None if link is None else {k: _plain(link[k]) for k in sorted(link)},
        "decided": decided,
    }


def _plain(value: Any) -> Any:
    """A sequence as a list (JSON's form, so a restored memory compares equal)."""
    return list(value) if isinstance(value, tuple | list) else value
