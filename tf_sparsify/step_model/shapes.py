"""The what-if's model: the shapes of its trainable tensors, and the benchmark's MLP."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tf_sparsify.common.checks import check_int, is_number


@dataclass(frozen=True)
class Layers:
    """The shapes of a model's trainable tensors (each a tuple of positive ints)."""

    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        if not self.shapes:
            raise ValueError("`shapes` must hold at least one tensor shape")
        for shape in self.shapes:
            if not shape or any(not is_number(d, int) or d < 1 for d in shape):
                raise ValueError(f"`shapes` must hold tuples of integers >= 1; got {shape!r}")

    @classmethod
    def from_params(cls, num_params: int) -> Layers:
        """One tensor of ``num_params`` entries seen as a near-square matrix ``a x (n // a)``,
        ``a = isqrt(n)``, plus a vector of the remainder (what PowerSGD would factor)."""
        n = check_int("num_params", num_params)
        a = math.isqrt(n)
        rest = n - a * (n // a)
        return cls(((a, n // a),) + (((rest,),) if rest else ()))

    @property
    def sizes(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]

    @property
    def num_params(self) -> int:
        return sum(self.sizes)


def mlp_layers(widths: Sequence[int]) -> Layers:
    """Kernels and biases of a dense MLP ``widths[0] -> ... -> widths[-1]``."""
    pairs = zip(widths[:-1], widths[1:], strict=False)
    return Layers(tuple(s for a, b in pairs for s in ((a, b), (b,))))


#: the benchmark's ``mlp10m``: 784 -> 2048 x 3 -> 10, 10.0M parameters
MLP10M = mlp_layers((784, 2048, 2048, 2048, 10))
