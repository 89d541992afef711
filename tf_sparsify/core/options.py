"""``ExchangeOptions``: how gradients are exchanged, besides the compressor, declared once.

Every front end (``SparsifiedOptimizer`` and its subclasses, Horovod's ``DistributedOptimizer``
and ``GradientExchange``) takes these as keyword arguments and hands them here; the pipeline
reads them from here, and configs are written from here. A new option is one field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tf_sparsify.common.checks import check_int, check_number
from tf_sparsify.compressors.base import Compressor, MultiRoundMethod
from tf_sparsify.heuristics import clipping
from tf_sparsify.step_model.buckets import DEFAULT_BUCKET_BYTES
from tf_sparsify.step_model.predict import LATE_BUCKETS

SCOPES = ("layer", "global")
#: options written to configs only when they differ from their default (added after the
#: first release, so older configs stay as they were)
_WRITTEN_WHEN_SET = (
    "skip_1d",
    "momentum_correction",
    "local_clipnorm",
    "bucket_bytes",
    "late_buckets",
)


@dataclasses.dataclass(frozen=True)
class ExchangeOptions:
    """How gradients are exchanged, besides the compressor.

    Args:
        error_feedback: keep residuals; ``None`` means on for biased compressors (resolved by
            :meth:`for_compressor`).
        scope: ``"layer"`` compresses each tensor alone, ``"global"`` all tensors of one dtype
            flattened together.
        min_size: tensors with fewer entries travel uncompressed, without memory.
        skip_1d: tensors of rank 0 or 1 (biases, normalization scales) also travel
            uncompressed, without memory.
        momentum_correction: DGC momentum correction with momentum factor masking, with this
            momentum factor in [0, 1); 0 is off (see :mod:`tf_sparsify.compressors.error_memory`).
        local_clipnorm: clip each replica's gradients by their joint norm before accumulation,
            the threshold scaled by ``1/sqrt(num_replicas)`` (see
            :mod:`tf_sparsify.heuristics.clipping`); ``None`` is off. It needs the norm of all
            gradients, so no bucket can start before the last gradient is ready.
        bucket_bytes: units travel in buckets of about this many bytes of dense gradient, in
            backprop order (``None``: :data:`DEFAULT_BUCKET_BYTES`).
        late_buckets: which buckets are exchanged one step late, while the next step computes
            (:mod:`tf_sparsify.core.late`): ``"none"`` (synchronous), ``"last"`` (the bucket
            backprop fills last, the first layers') or ``"all"`` (every bucket); their update is
            applied one step late.
    """

    error_feedback: bool | None = None
    scope: str = "layer"
    min_size: int = 0
    skip_1d: bool = False
    momentum_correction: float = 0.0
    local_clipnorm: float | None = None
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
    late_buckets: str = "none"

    def __post_init__(self):
        if self.error_feedback is not None and not isinstance(self.error_feedback, bool):
            raise ValueError(
                "`error_feedback` must be True, False or None; "
                f"received error_feedback={self.error_feedback!r}"
            )
        if self.scope not in SCOPES:
            raise ValueError(f"`scope` must be one of {SCOPES}; received scope={self.scope!r}")
        self._set("min_size", check_int("min_size", self.min_size, minimum=0))
        if not isinstance(self.skip_1d, bool):
            raise ValueError(f"`skip_1d` must be True or False; received skip_1d={self.skip_1d!r}")
        self._set("momentum_correction", _check_momentum(self.momentum_correction))
        self._set("local_clipnorm", clipping.check_clipnorm(self.local_clipnorm))
        bucket = self.bucket_bytes
        self._set(
            "bucket_bytes",
            DEFAULT_BUCKET_BYTES if bucket is None else check_int("bucket_bytes", bucket),
        )
        if self.late_buckets not in LATE_BUCKETS:
            raise ValueError(
                f"`late_buckets` must be one of {LATE_BUCKETS}; "
                f"received late_buckets={self.late_buckets!r}"
            )
        if self.late_buckets != "none" and self.local_clipnorm is not None:
            raise ValueError(
                "`local_clipnorm` clips by the joint norm of one step's gradients, but with "
                f"late_buckets={self.late_buckets!r} two steps' gradients travel together: "
                "use one of them."
            )

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, as front ends take them."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def take(cls, kwargs: dict[str, Any]) -> ExchangeOptions:
        """The options among ``kwargs``, removed from it (a front end's other arguments stay)."""
        return cls(**{name: kwargs.pop(name) for name in cls.names() if name in kwargs})

    def for_compressor(self, compressor: Compressor) -> ExchangeOptions:
        """These options with ``error_feedback`` resolved for ``compressor`` (on for biased
        ones), checked against what it can honour."""
        resolved = self
        if self.error_feedback is None:
            resolved = dataclasses.replace(self, error_feedback=not compressor.unbiased)
        _check_compressor(compressor, resolved)
        return resolved

    def get_config(self) -> dict[str, Any]:
        """The options as a config: the first ones always, later ones only when set."""
        config = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name not in _WRITTEN_WHEN_SET or value != field.default:
                config[field.name] = value
        return config


def _check_momentum(factor: Any) -> float:
    """A momentum factor in ``[0, 1)``; 0 means off."""
    return check_number("momentum_correction", factor, 0, 1, high_open=True)


def _check_compressor(compressor: Compressor, options: ExchangeOptions) -> None:
    """ValueError for options a compressor cannot honour: ``scope="global"`` for a shape-aware
    one, momentum correction for one that runs its own exchange (it reports no sent entries
    to mask the momentum at, and keeps no momentum buffers)."""
    if options.scope == "global" and compressor.shape_aware:
        raise ValueError(
            f"`scope='global'` joins the gradients into one flat vector, but {compressor!r} "
            "compresses each tensor by its shape: use scope='layer'."
        )
    if options.momentum_correction > 0 and isinstance(compressor, MultiRoundMethod):
        raise ValueError(
            f"`momentum_correction` masks the momentum where a payload sent entries; "
            f"{compressor!r} runs its own exchange, which sends no such entries and keeps no "
            "momentum buffers: use the inner optimizer's momentum (momentum_correction=0)."
        )
