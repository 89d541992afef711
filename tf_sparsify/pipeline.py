"""The one gradient pipeline every front end uses.

For a list of gradients it: filters (``min_size``, ``None``), compensates with the error memory,
compresses, exchanges through a :class:`~tf_sparsify.collectives.Collective`, decompresses,
averages, and returns the updates, the new residuals and whether the step was finite. It holds
no variables: the front end owns the residual variables and writes them.

Non-finite policy: a replica whose accumulated gradient (or, without error feedback, gradient)
has a NaN or Inf marks its payload non-finite, so every replica's averaged update is non-finite
and all of them agree the step is bad (``finite`` is False). Front ends then keep the residuals
as they were (nothing is lost, nothing is poisoned) and hand the update on unchanged, so a
``LossScaleOptimizer`` inside sees the overflow and skips the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

from tf_sparsify.collectives import Collective
from tf_sparsify.compressors.base import Compressor, check_float, dtype_bytes, serialize
from tf_sparsify.compressors.dense import Identity
from tf_sparsify.heuristics import clipping, momentum
from tf_sparsify.heuristics.measure import STAT_NAMES, unit_stats

SCOPES = ("layer", "global")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One message: the variables it carries, how it is compressed, and whether it has memory."""

    indices: tuple[int, ...]
    shapes: tuple[tf.TensorShape, ...]
    dtype: tf.DType
    compressor: Compressor
    error_feedback: bool

    @property
    def num_elements(self) -> int:
        return sum(s.num_elements() for s in self.shapes)

    @property
    def wire_bytes(self) -> int:
        return self.compressor.wire_bytes(self.num_elements, self.dtype)

    @property
    def dense_bytes(self) -> int:
        return self.num_elements * dtype_bytes(self.dtype)


@dataclasses.dataclass
class StepResult:
    """What one pipeline step produced; lists are aligned with the input gradients."""

    updates: list[tf.Tensor | None]
    residuals: list[tf.Tensor | None]
    finite: tf.Tensor
    #: new momentum buffers (aligned like ``residuals``) when momentum correction is on.
    momenta: list[tf.Tensor | None] | None = None
    #: ``[len(units), 5]`` float64 rows of :func:`tf_sparsify.heuristics.measure.unit_stats`
    #: when ``step(..., measure=...)`` was given (zeros on steps where it was False).
    stats: tf.Tensor | None = None
    #: ``(wire bytes, dense bytes)`` this replica sent in the step (only variables with a
    #: gradient travel).
    sent_bytes: tuple[int, int] = (0, 0)


class GradientPipeline:
    """Plans messages for a list of variables and runs one exchange step.

    Args:
        compressor: the compressor for tensors of at least ``min_size`` entries.
        error_feedback: keep residuals; ``None`` means on for biased compressors.
        scope: ``"layer"`` compresses each tensor alone, ``"global"`` all tensors of one dtype
            flattened together.
        min_size: tensors with fewer entries travel uncompressed, without memory.
        skip_1d: tensors of rank 0 or 1 (biases, normalization scales) also travel
            uncompressed, without memory.
        momentum_correction: DGC momentum correction with momentum factor masking, with this
            momentum factor in [0, 1); 0 is off. Needs a momentum buffer per variable (see
            :mod:`tf_sparsify.heuristics.momentum`); the inner optimizer should then be plain SGD.
        local_clipnorm: clip each replica's gradients by their joint norm before accumulation,
            the threshold scaled by ``1/sqrt(num_replicas)`` (see
            :mod:`tf_sparsify.heuristics.clipping`); ``None`` is off.
    """

    def __init__(
        self,
        compressor: Compressor,
        error_feedback: bool | None = None,
        scope: str = "layer",
        min_size: int = 0,
        skip_1d: bool = False,
        momentum_correction: float = 0.0,
        local_clipnorm: float | None = None,
    ):
        if not isinstance(compressor, Compressor):
            raise ValueError(
                f"`compressor` must be a tf_sparsify Compressor; received compressor={compressor!r}"
            )
        if scope not in SCOPES:
            raise ValueError(f"`scope` must be one of {SCOPES}; received scope={scope!r}")
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
            raise ValueError(f"`min_size` must be an integer >= 0; received min_size={min_size!r}")
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise ValueError(
                "`error_feedback` must be True, False or None; "
                f"received error_feedback={error_feedback!r}"
            )
        self.compressor = compressor
        self.error_feedback = (
            (not compressor.unbiased) if error_feedback is None else error_feedback
        )
        self.scope = scope
        self.min_size = min_size
        if not isinstance(skip_1d, bool):
            raise ValueError(f"`skip_1d` must be True or False; received skip_1d={skip_1d!r}")
        self.skip_1d = skip_1d
        self.momentum_correction = momentum.check_momentum(momentum_correction)
        self.local_clipnorm = clipping.check_clipnorm(local_clipnorm)

    # -- planning (static, from shapes) -------------------------------------------------------
    def plan(self, shapes: Sequence[tf.TensorShape], dtypes: Sequence[tf.DType]) -> list[Unit]:
        """The messages of one step for variables of these shapes and dtypes."""
        compressed, dense = [], []
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
            check_float("gradient", dtype)
            shape = tf.TensorShape(shape)
            if not shape.is_fully_defined():
                raise ValueError(f"Gradient shapes must be fully defined; received shape={shape}")
            small = shape.num_elements() < max(self.min_size, 1)
            flat = self.skip_1d and shape.rank < 2
            (dense if small or flat else compressed).append(i)
        units = [
            Unit((i,), (tf.TensorShape(shapes[i]),), tf.as_dtype(dtypes[i]), Identity(), False)
            for i in dense
        ]
        groups = [[i] for i in compressed]
        if self.scope == "global":
            by_dtype: dict[tf.DType, list[int]] = {}
            for i in compressed:
                by_dtype.setdefault(tf.as_dtype(dtypes[i]), []).append(i)
            groups = list(by_dtype.values())
        for group in groups:
            units.append(
                Unit(
                    tuple(group),
                    tuple(tf.TensorShape(shapes[i]) for i in group),
                    tf.as_dtype(dtypes[group[0]]),
                    self.compressor,
                    self.error_feedback,
                )
            )
        return sorted(units, key=lambda u: u.indices[0])

    def needs_momentum(self, units: Sequence[Unit], num_variables: int) -> list[bool]:
        """Which variables need a momentum buffer (all planned ones with momentum correction)."""
        flags = [False] * num_variables
        if self.momentum_correction > 0:
            for unit in units:
                for i in unit.indices:
                    flags[i] = True
        return flags

    def needs_residual(self, units: Sequence[Unit], num_variables: int) -> list[bool]:
        """Which variables need a residual buffer."""
        flags = [False] * num_variables
        for unit in units:
            for i in unit.indices:
                flags[i] = unit.error_feedback
        return flags

    # -- one step ---------------------------------------------------------------------------
    def step(
        self,
        units: Sequence[Unit],
        grads: Sequence[tf.Tensor | None],
        residuals: Sequence[tf.Tensor | None],
        step: tf.Tensor,
        collective: Collective,
        momenta: Sequence[tf.Tensor | None] | None = None,
        measure: tf.Tensor | bool | None = None,
        per_replica: bool = False,
    ) -> StepResult:
        """Exchange ``grads`` (aligned with the planned variables) and return the updates.

        Variables whose gradient is ``None`` are left out of their unit (they keep their values,
        and their residuals and momenta stay as they were); the others travel.
        ``momenta``: the momentum buffers, needed when momentum correction is on. ``measure``:
        when given, ``StepResult.stats`` holds this replica's measurements of the step, computed
        only where ``measure`` is True (a boolean tensor, e.g. every N steps). ``per_replica``:
        every payload travels by all-gather and each update gets a leading axis of size
        ``collective.num_replicas`` holding every replica's decompressed contribution (divided
        by ``divisor``); their sum is the usual update (for delayed updates and IAG).
        """
        replica_id = collective.replica_id()
        use_momentum = self.momentum_correction > 0
        if use_momentum and momenta is None:
            raise ValueError("Momentum correction is on: `momenta` must be given to step().")
        if self.local_clipnorm is not None:
            grads = clipping.clip_by_local_norm(
                [None if g is None else _dense(g) for g in grads],
                self.local_clipnorm,
                collective.num_replicas,
                collective.divisor,
            )
        active = [p for p in (_with_gradients(u, grads) for u in units) if p is not None]
        messages, local_ok, probes = [], [], {}
        new_momenta: list[tf.Tensor | None] | None = [None] * len(grads) if use_momentum else None
        for unit in active:
            g = _join([_dense(grads[i]) for i in unit.indices], unit.shapes)
            x, e = g, None
            if use_momentum:
                buffer = _join([momenta[i] for i in unit.indices], unit.shapes)
                x = momentum.accumulate_momentum(buffer, g, self.momentum_correction)
            tensor_id = unit.indices[0]
            if unit.error_feedback:
                e = _join([residuals[i] for i in unit.indices], unit.shapes)
                payload, ctx, remainder = unit.compressor.compress_with_feedback(
                    x, e, step, tensor_id, replica_id
                )
                local_ok += [_all_finite(remainder)] + [_all_finite(t) for t in _floats(payload)]
            else:
                payload, ctx = unit.compressor.compress(x, step, tensor_id, replica_id)
                remainder = None
                if not isinstance(unit.compressor, Identity):
                    local_ok.append(_all_finite(x))
            if use_momentum:
                buffer = x
                if unit.error_feedback:
                    buffer = momentum.mask_momentum(
                        x, momentum.sent_mask(unit.compressor, payload, ctx)
                    )
                for i, part in zip(unit.indices, _split(buffer, unit.shapes), strict=True):
                    new_momenta[i] = part
            probes[_planned(units, unit).indices] = (unit, g, x, e, remainder, payload, ctx)
            messages.append((unit, payload, ctx, remainder))

        if local_ok:
            ok = tf.reduce_all(tf.stack(local_ok))
            poison = tf.where(ok, 0.0, float("nan"))
            messages = [(u, _mark(p, poison), c, r) for u, p, c, r in messages]

        def sums(unit: Unit) -> bool:
            return unit.compressor.summable and not per_replica

        summed = collective.all_reduce_sum([t for u, p, _, _ in messages if sums(u) for t in p])
        gathered = collective.all_gather([t for u, p, _, _ in messages if not sums(u) for t in p])

        summed, gathered = iter(summed), iter(gathered)
        updates: list[tf.Tensor | None] = [None] * len(grads)
        new_residuals: list[tf.Tensor | None] = [None] * len(grads)
        finite = []
        for unit, payload, ctx, remainder in messages:
            source = summed if sums(unit) else gathered
            received = tuple(next(source) for _ in payload)
            if per_replica:
                total = tf.stack(
                    [
                        unit.compressor.decompress(tuple(t[r] for t in received), ctx)
                        for r in range(collective.num_replicas)
                    ]
                )
            elif unit.compressor.summable:
                total = unit.compressor.decompress(received, ctx)
            else:
                total = unit.compressor.decompress_sum(received, ctx, collective.num_replicas)
            if collective.divisor != 1:
                total = total * tf.cast(1.0 / collective.divisor, total.dtype)
            finite.append(_all_finite(total))
            parts = _split(total, unit.shapes, leading=int(per_replica))
            for i, part in zip(unit.indices, parts, strict=True):
                updates[i] = part
            if remainder is not None:
                for i, part in zip(unit.indices, _split(remainder, unit.shapes), strict=True):
                    new_residuals[i] = part
        all_finite = tf.reduce_all(tf.stack(finite)) if finite else tf.constant(True)
        stats = None
        if measure is not None:
            stats = _measure(units, probes, measure, step, replica_id)
        return StepResult(
            updates, new_residuals, all_finite, new_momenta, stats, bytes_per_step(active)
        )

    def get_config(self) -> dict:
        return {
            "compressor": serialize(self.compressor),
            "error_feedback": self.error_feedback,
            "scope": self.scope,
            "min_size": self.min_size,
            # options added later appear only when set, so older configs stay as they were
            **({"skip_1d": True} if self.skip_1d else {}),
            **(
                {"momentum_correction": self.momentum_correction}
                if self.momentum_correction
                else {}
            ),
            **({"local_clipnorm": self.local_clipnorm} if self.local_clipnorm is not None else {}),
        }


def bytes_per_step(units: Sequence[Unit]) -> tuple[int, int]:
    """``(wire bytes, dense bytes)`` one replica sends per step for these messages."""
    return sum(u.wire_bytes for u in units), sum(u.dense_bytes for u in units)


def _measure(units: Sequence[Unit], probes: dict, flag, step, replica_id) -> tf.Tensor:
    """``[len(units), 5]`` stats rows, computed only when ``flag`` is True (zeros otherwise)."""
    width = len(STAT_NAMES)

    def compute():
        rows = []
        for planned in units:
            if planned.indices not in probes:
                rows.append(tf.zeros([width], tf.float64))
                continue
            # the unit as sent: its variables that had a gradient
            unit, g, x, e, remainder, payload, ctx = probes[planned.indices]
            acc = x if e is None else x + e
            error = remainder
            if error is None:
                error = acc - unit.compressor.decompress(payload, ctx)
            if isinstance(unit.compressor, Identity):
                grad_error = tf.zeros_like(g)
            else:  # the same compressor on the fresh gradient alone
                fresh, fresh_ctx = unit.compressor.compress(g, step, unit.indices[0], replica_id)
                grad_error = g - unit.compressor.decompress(fresh, fresh_ctx)
            rows.append(unit_stats(g, acc, error, grad_error))
        return tf.stack(rows) if rows else tf.zeros([0, width], tf.float64)

    def skip():
        return tf.zeros([len(units), width], tf.float64)

    return tf.cond(tf.convert_to_tensor(flag, tf.bool), compute, skip)


def _with_gradients(unit: Unit, grads: Sequence[tf.Tensor | None]) -> Unit | None:
    """``unit`` restricted to its variables that have a gradient (``None`` if none has)."""
    present = [j for j, i in enumerate(unit.indices) if grads[i] is not None]
    if len(present) == len(unit.indices):
        return unit
    if not present:
        return None
    return dataclasses.replace(
        unit,
        indices=tuple(unit.indices[j] for j in present),
        shapes=tuple(unit.shapes[j] for j in present),
    )


def _planned(units: Sequence[Unit], part: Unit) -> Unit:
    """The planned unit that ``part`` (a unit restricted by :func:`_with_gradients`) came from."""
    return next(u for u in units if part.indices[0] in u.indices)


def _dense(grad) -> tf.Tensor:
    """IndexedSlices (Embedding gradients) become dense: the residual is dense anyway."""
    return tf.convert_to_tensor(grad)


def _join(tensors: list[tf.Tensor], shapes: tuple[tf.TensorShape, ...]) -> tf.Tensor:
    """One tensor as it is, several flattened and concatenated."""
    if len(tensors) == 1:
        return tensors[0]
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)


def _split(
    tensor: tf.Tensor, shapes: tuple[tf.TensorShape, ...], leading: int = 0
) -> list[tf.Tensor]:
    """Inverse of :func:`_join`, on the axes after the first ``leading`` ones."""
    if len(shapes) == 1:
        return [tensor]
    parts = tf.split(tensor, [s.num_elements() for s in shapes], axis=leading)
    lead = tensor.shape[:leading]
    return [tf.reshape(p, lead.concatenate(s)) for p, s in zip(parts, shapes, strict=True)]


def _floats(payload) -> list[tf.Tensor]:
    return [t for t in payload if t.dtype.is_floating]


def _all_finite(t: tf.Tensor) -> tf.Tensor:
    return tf.reduce_all(tf.math.is_finite(t))


def _mark(payload, poison: tf.Tensor):
    """Add ``poison`` (0 or NaN) to every float tensor of the payload."""
    return tuple(t + tf.cast(poison, t.dtype) if t.dtype.is_floating else t for t in payload)
