"""Density warm-up: send more entries in the first epochs, then the target density.

DGC (Lin et al. 2018, section 3.3) raises the sparsity exponentially over the first epochs:
densities 25%, 6.25%, 1.5625%, 0.390625%, then the target (e.g. 0.1%). A compressor's ``k`` is
static in a traced step, so a schedule is applied between epochs by replacing the compressor and
retracing the step (see :class:`tf_sparsify.keras.DensityWarmup`); wire-byte counts follow.
"""

from __future__ import annotations

from collections.abc import Sequence

from tf_sparsify.common.checks import check_int, check_number
from tf_sparsify.compressors.base import Compressor, check_ratio


class DensitySchedule:
    """Density per epoch: ``values[epoch]`` during warm-up, ``target`` afterwards.

    Args:
        target: the density after warm-up, in (0, 1].
        values: densities of the first ``len(values)`` epochs; each is raised to ``target``
            when smaller (warm-up never sends fewer entries than the target).
    """

    def __init__(self, target: float, values: Sequence[float] = ()):
        self.target = check_ratio(target)
        self.values = tuple(max(check_ratio(v), self.target) for v in values)

    def __call__(self, epoch: int) -> float:
        check_int("epoch", epoch, minimum=0)
        return self.values[epoch] if epoch < len(self.values) else self.target

    @property
    def warmup_epochs(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        return f"DensitySchedule(target={self.target!r}, values={list(self.values)!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DensitySchedule)
            and self.target == other.target
            and self.values == other.values
        )

    def __hash__(self) -> int:
        return hash((self.target, self.values))


def dgc_density_schedule(
    target: float, warmup_epochs: int = 4, start: float = 0.25, factor: float = 0.25
) -> DensitySchedule:
    """DGC's exponential warm-up: ``start * factor**epoch`` for ``epoch < warmup_epochs``.

    The defaults give 0.25, 0.0625, 0.015625, 0.00390625, then ``target``.
    """
    check_int("warmup_epochs", warmup_epochs, minimum=0)
    start = check_ratio(start)
    check_number("factor", factor, 0, 1, low_open=True)
    return DensitySchedule(target, [start * factor**e for e in range(warmup_epochs)])


def with_density(compressor: Compressor, density: float) -> Compressor:
    """A copy of ``compressor`` keeping ``density`` of the entries (it must take ``ratio``).

    TopK given by ``k`` becomes TopK by ``ratio``.
    """
    density = check_ratio(density)
    config = compressor.get_config()
    if "ratio" not in config:
        raise ValueError(
            f"A density schedule needs a compressor with a `ratio` (TopK, RandomK); "
            f"received compressor={compressor!r}"
        )
    config["ratio"] = density
    if "k" in config:
        config["k"] = None
    return type(compressor).from_config(config)
