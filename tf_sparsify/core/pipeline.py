"""The one gradient pipeline every front end uses.

A step runs named stages on one :class:`Message` per planned unit: :meth:`~GradientPipeline.
prepare` (densify, local clipping), :meth:`~GradientPipeline.compress` (momentum correction,
compensation with the residual, compression), :meth:`~GradientPipeline.exchange` (through a
:class:`~tf_sparsify.collectives.base.Collective`), :meth:`~GradientPipeline.decompress` (and
average), then the updates, new residuals and momenta are assembled and, when asked,
:meth:`~GradientPipeline.measure` records diagnostics. It holds no variables: the state core
(:class:`~tf_sparsify.core.state.CompressionState`) owns them and writes them back.

Buckets: units travel in buckets of about ``bucket_bytes`` of dense gradient, in backprop order
(the last variables' gradients are ready first). A bucket's compression and exchange depend
only on its own gradients, so the collectives of late layers can run while earlier gradients
are still being computed (``scope="global"`` makes one unit of all gradients of a dtype: it
cannot overlap).

Non-finite policy: a step is finite when every bucket's received payloads are. Compressors
whose payload shows a non-finite input (``reveals_non_finite``: TopK sends NaN and Inf first,
QSGD's norms and the scales become non-finite, casts keep them) need nothing more; others mark
their payload non-finite when what they keep (residual, momentum) would be. So every replica
sees the same payloads and agrees whether the step is bad; the state core then keeps the
residuals as they were (nothing is lost, nothing is poisoned) and the update goes on unchanged,
so a ``LossScaleOptimizer`` inside sees the overflow and skips the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_sparsify.collectives.base import Collective
from tf_sparsify.common.checks import check_float_dtype
from tf_sparsify.common.dtypes import dtype_bytes
from tf_sparsify.compressors import error_memory as memory
from tf_sparsify.compressors import topk_bucket
from tf_sparsify.compressors.base import (
    Codec,
    Compressor,
    Context,
    Payload,
    check_contraction,
    serialize,
)
from tf_sparsify.compressors.dense import Identity
from tf_sparsify.compressors.error_memory import UnitMemory
from tf_sparsify.compressors.rounds import (
    ALL_TO_ALL,
    GATHER,
    GATHER_ROWS,
    SUM,
    Outcome,
    Protocol,
    Replicas,
    SparseUpdate,
    Transfer,
)
from tf_sparsify.core import sparse_rows
from tf_sparsify.core.measurements import STAT_NAMES, unit_stats
from tf_sparsify.core.options import ExchangeOptions
from tf_sparsify.heuristics import clipping
from tf_sparsify.ops.xla import in_xla_context


@dataclasses.dataclass(frozen=True)
class Unit:
    """One message: the variables it carries, how it is compressed, and whether it has memory."""

    indices: tuple[int, ...]
    shapes: tuple[tf.TensorShape, ...]
    dtype: tf.DType
    compressor: Compressor
    error_feedback: bool
    #: the bucket the unit's payload travels in (0 travels first, in backprop order)
    bucket: int = 0

    @property
    def num_elements(self) -> int:
        return sum(s.num_elements() for s in self.shapes)

    @property
    def shape(self) -> tf.TensorShape:
        """The shape of the tensor the compressor sees: the variable's, or flat for several."""
        return self.shapes[0] if len(self.shapes) == 1 else tf.TensorShape([self.num_elements])

    @property
    def wire_bytes(self) -> int:
        return self.compressor.wire_bytes_for(self.shape, self.dtype)

    @property
    def dense_bytes(self) -> int:
        return self.num_elements * dtype_bytes(self.dtype)


@dataclasses.dataclass(frozen=True)
class PackedUnit(Unit):
    """One-variable TopK units of a bucket sent as one packed payload
    (:mod:`tf_sparsify.compressors.topk_bucket`); their bytes are those of its ``parts``."""

    parts: tuple[Unit, ...] = ()

    @property
    def wire_bytes(self) -> int:
        return sum(u.wire_bytes for u in self.parts)

    @property
    def dense_bytes(self) -> int:
        return sum(u.dense_bytes for u in self.parts)


@dataclasses.dataclass
class Message:
    """One unit's trip through a step; each stage fills in its part."""

    #: the unit as sent: only its variables that have a gradient
    unit: Unit
    #: the fresh gradient (the unit's gradients flattened and joined when there are several)
    grad: tf.Tensor
    #: what is compressed with the residual: ``grad``, or the momentum-corrected gradient
    x: tf.Tensor
    #: the unit's memory before the step
    before: UnitMemory
    payload: Payload
    ctx: Context
    #: the exchange protocol driving this message's transfers
    protocol: Protocol | None = None
    #: the unit's memory after the step (complete once the exchange is done)
    after: UnitMemory = UnitMemory()
    #: the decompressed, averaged update (stacked over replicas with ``per_replica``)
    update: tf.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one pipeline step produced; lists are aligned with the input gradients."""

    updates: list[tf.Tensor | SparseUpdate | None]
    residuals: list[tf.Tensor | None]
    finite: tf.Tensor
    #: new momentum buffers (aligned like ``residuals``) when momentum correction is on.
    momenta: list[tf.Tensor | None] | None = None
    #: ``[len(units), 5]`` float64 rows of :func:`tf_sparsify.core.measurements.unit_stats`
    #: when ``run_step(..., measure=...)`` was given (zeros on steps where it was False).
    stats: tf.Tensor | None = None
    #: ``(wire bytes, dense bytes)`` this replica sent in the step (only variables with a
    #: gradient travel).
    sent_bytes: tuple[int | tf.Tensor, int] = (0, 0)
    #: each planned unit's new compressor state (``None`` where none was sent)
    states: list[tuple[tf.Tensor, ...] | None] | None = None


class GradientPipeline:
    """Plans messages for a list of variables and runs one exchange step.

    Args:
        compressor: the compressor for tensors that are compressed (see ``options``).
        options: an :class:`~tf_sparsify.core.options.ExchangeOptions`, or its fields as keyword
            arguments (``error_feedback``, ``scope``, ``min_size``, ``skip_1d``,
            ``momentum_correction``, ``local_clipnorm``, ``bucket_bytes``). They read as
            attributes of the pipeline (``pipeline.scope``), ``error_feedback`` resolved.
    """

    def __init__(
        self, compressor: Compressor, options: ExchangeOptions | None = None, **kwargs: Any
    ):
        if not isinstance(compressor, Compressor):
            raise ValueError(
                f"`compressor` must be a tf_sparsify Compressor; received compressor={compressor!r}"
            )
        if options is None:
            options = ExchangeOptions.take(kwargs)
        elif not isinstance(options, ExchangeOptions):
            raise ValueError(f"`options` must be an ExchangeOptions; received options={options!r}")
        if kwargs:
            raise ValueError(
                f"GradientPipeline got unknown arguments {sorted(kwargs)}; its options are "
                f"{ExchangeOptions.names()}"
            )
        self.compressor = compressor
        self.options = options.for_compressor(compressor)

    def __getattr__(self, name: str) -> Any:
        """The options read as attributes (``pipeline.error_feedback``, resolved)."""
        options = self.__dict__.get("options")
        if options is not None and name in ExchangeOptions.names():
            return getattr(options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def with_compressor(self, compressor: Compressor) -> GradientPipeline:
        """The same pipeline with another compressor (error feedback as resolved here)."""
        return GradientPipeline(compressor, self.options)

    # -- planning (static, from shapes) -------------------------------------------------------
    def plan(self, shapes: Sequence[tf.TensorShape], dtypes: Sequence[tf.DType]) -> list[Unit]:
        """The messages of one step for variables of these shapes and dtypes.

        ValueError when error feedback is on and the compressor does not contract at the size
        of a message (see :meth:`Compressor.contraction`).
        """
        compressed, dense = [], []
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
            check_float_dtype("gradient", dtype)
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
        for unit in units:  # error feedback needs a contraction at the unit's size
            if unit.error_feedback:
                check_contraction(unit.compressor, unit.num_elements)
        return _in_buckets(units, self.bucket_bytes)

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
    def run_step(
        self,
        units: Sequence[Unit],
        grads: Sequence[tf.Tensor | None],
        residuals: Sequence[Any],
        iteration: tf.Tensor,
        collective: Collective,
        momenta: Sequence[tf.Tensor | None] | None = None,
        measure: tf.Tensor | bool | None = None,
        per_replica: bool = False,
        states: Sequence[tuple[tf.Tensor, ...]] | None = None,
        sparse_updates: bool = False,
    ) -> StepResult:
        """Exchange ``grads`` (aligned with the planned variables) and return the updates.

        ``residuals``: the residuals' values, or the variables holding them (this replica's
        value is read; a unit sent as rows reads only its touched rows).
        ``iteration``: the exchange's step counter, which keys random choices (with the
        tensor's and replica's ids). Variables whose gradient is ``None`` are left out of their
        unit (they keep their values, and their residuals and momenta stay as they were); the
        others travel.
        ``momenta``: the momentum buffers, needed when momentum correction is on. ``measure``:
        when given, ``StepResult.stats`` holds this replica's measurements of the step, computed
        only where ``measure`` is True (a boolean tensor, e.g. every N steps). ``per_replica``:
        every payload travels by all-gather and each update gets a leading axis of size
        ``collective.num_replicas`` holding every replica's decompressed contribution (divided
        by ``divisor``); their sum is the usual update (for delayed updates and IAG).
        ``states``: each planned unit's compressor state (``Compressor.state_specs``); the new
        ones are in ``StepResult.states``. ``sparse_updates``: a unit of one variable whose
        compressor sends entries gets a :class:`SparseUpdate` instead of a dense update.
        """
        if self.momentum_correction > 0 and momenta is None:
            raise ValueError("Momentum correction is on: `momenta` must be given to run_step().")
        if not self.compressor.runs_under_xla and in_xla_context():
            raise ValueError(
                f"{self.compressor!r} exchanges sizes that depend on the data, which XLA cannot "
                "compile: compile the Keras model with `jit_compile=False` and do not use "
                "tf.function(jit_compile=True) around the exchange."
            )
        rows = self._keeps_rows(units, grads, collective, measure is not None, per_replica)
        grads = self.prepare(grads, collective, rows)
        replicas = Replicas(collective.num_replicas, collective.replica_id(), collective.divisor)
        buckets: dict[int, list[Message]] = {}
        packed: dict[tuple[int, tf.DType], list[tuple[Unit, UnitMemory]]] = {}
        for index, unit in enumerate(units):
            sent = _with_gradients(unit, grads)
            if sent is not None:
                before = UnitMemory(
                    _residual(residuals, sent, rows) if sent.error_feedback else None,
                    _joined(momenta, sent.indices) if self.momentum_correction > 0 else None,
                    () if states is None else tuple(states[index]),
                )
                if measure is None and not per_replica and self._packs(sent, grads, before):
                    buckets.setdefault(unit.bucket, [])
                    packed.setdefault((unit.bucket, sent.dtype), []).append((sent, before))
                    continue
                if isinstance(grads[sent.indices[0]], tf.IndexedSlices):
                    message = self.compress_rows(sent, grads, before, replicas)
                else:
                    message = self.compress(
                        sent, grads, before, iteration, replicas, per_replica, sparse_updates
                    )
                buckets.setdefault(unit.bucket, []).append(message)
        for (bucket, _), group in packed.items():
            buckets[bucket].append(
                self.compress_packed(group, grads, iteration, replicas, sparse_updates)
            )
        finite = [self.exchange(bucket, collective) for bucket in buckets.values()]
        messages = [m for bucket in buckets.values() for m in bucket]
        per_variable = _per_variable(messages, len(grads), per_replica)
        return StepResult(
            updates=per_variable["update"],
            residuals=per_variable["residual"],
            finite=tf.reduce_all(tf.stack(finite)) if finite else tf.constant(True),
            momenta=per_variable["momentum"] if self.momentum_correction > 0 else None,
            stats=None
            if measure is None
            else self.measure(units, messages, measure, iteration, replicas.replica_id),
            sent_bytes=_sent_bytes(messages),
            states=[
                next(
                    (m.after.compressor_state for m in messages if m.unit.indices == u.indices),
                    None,
                )
                for u in units
            ],
        )

    def _keeps_rows(
        self,
        units: Sequence[Unit],
        grads: Sequence[tf.Tensor | None],
        collective: Collective,
        measured: bool,
        per_replica: bool,
    ) -> frozenset[int]:
        """The variables whose ``IndexedSlices`` gradient travels as rows
        (:func:`tf_sparsify.core.sparse_rows.keeps_rows`; one-variable units only; under XLA
        padded to a bound the batch gives)."""
        if not collective.gathers_rows:
            return frozenset()
        return frozenset(
            u.indices[0]
            for u in units
            if len(u.indices) == 1
            and isinstance(grads[u.indices[0]], tf.IndexedSlices)
            and sparse_rows.keeps_rows(
                u.compressor,
                self.momentum_correction > 0,
                self.local_clipnorm is not None,
                measured,
                per_replica,
            )
        )

    def prepare(
        self,
        grads: Sequence[tf.Tensor | None],
        collective: Collective,
        rows: frozenset[int] = frozenset(),
    ) -> list[tf.Tensor | None]:
        """Dense gradients, except the ``IndexedSlices`` of the variables in ``rows`` (they
        travel as rows, :mod:`tf_sparsify.core.sparse_rows`; others are densified), clipped by
        their local norm when ``local_clipnorm`` is set."""
        grads = [
            None if g is None else g if i in rows else tf.convert_to_tensor(g)
            for i, g in enumerate(grads)
        ]
        if self.local_clipnorm is None:
            return grads
        return clipping.clip_by_local_norm(
            grads, self.local_clipnorm, collective.num_replicas, collective.divisor
        )

    def compress(
        self,
        unit: Unit,
        grads: Sequence[tf.Tensor | None],
        before: UnitMemory,
        iteration: tf.Tensor,
        replicas: Replicas,
        per_replica: bool = False,
        sparse_update: bool = False,
    ) -> Message:
        """Momentum correction, compensation with the residual and compression of one unit
        (the rules of :mod:`tf_sparsify.compressors.error_memory`); the message carries the
        protocol its
        payloads travel by (ending in a :class:`SparseUpdate` with ``sparse_update`` when the
        unit is one variable whose compressor sends entries)."""
        g = _joined(grads, unit.indices)
        x = g
        if before.momentum is not None:
            x = memory.accumulate_momentum(before.momentum, g, self.momentum_correction)
        opening = unit.compressor.start(
            x,
            before,
            iteration,
            unit.indices[0],
            replicas,
            per_replica,
            sparse_update and len(unit.shapes) == 1,
        )
        return Message(
            unit, g, x, before, opening.payload, opening.ctx, opening.protocol, opening.after
        )

    def compress_rows(
        self,
        unit: Unit,
        grads: Sequence[tf.Tensor | tf.IndexedSlices | None],
        before: UnitMemory,
        replicas: Replicas,
    ) -> Message:
        """The touched rows of a one-variable unit's ``IndexedSlices`` gradient, compressed with
        their residual (:mod:`tf_sparsify.core.sparse_rows`)."""
        g = grads[unit.indices[0]]
        opening = sparse_rows.start(unit.compressor, g, unit.shape, before, replicas)
        return Message(
            unit, g, g, before, opening.payload, opening.ctx, opening.protocol, opening.after
        )

    def _packs(self, unit: Unit, grads: Sequence, before: UnitMemory) -> bool:
        """Whether ``unit`` travels in its bucket's packed TopK payload: one dense variable
        with error feedback, no momentum correction, no compressor state, no XLA."""
        return (
            unit.error_feedback
            and len(unit.shapes) == 1
            and before.momentum is None
            and not before.compressor_state
            and not isinstance(grads[unit.indices[0]], tf.IndexedSlices)
            and not in_xla_context()
            and topk_bucket.packs(unit.compressor, unit.dtype)
        )

    def compress_packed(
        self,
        group: list[tuple[Unit, UnitMemory]],
        grads: Sequence[tf.Tensor | None],
        iteration: tf.Tensor,
        replicas: Replicas,
        sparse_updates: bool,
    ) -> Message:
        """One message for a bucket's packable units (:meth:`_packs`): compressed together
        when there are several, as :meth:`compress` when alone."""
        if len(group) == 1:
            unit, before = group[0]
            return self.compress(unit, grads, before, iteration, replicas, False, sparse_updates)
        units = [u for u, _ in group]
        tensors = tuple(grads[u.indices[0]] for u in units)
        payload, rounds, after = topk_bucket.start(
            units, tensors, [b.residual for _, b in group], replicas, sparse_updates
        )
        unit = PackedUnit(
            tuple(u.indices[0] for u in units),
            tuple(u.shapes[0] for u in units),
            units[0].dtype,
            units[0].compressor,
            True,
            units[0].bucket,
            tuple(units),
        )
        before = UnitMemory([b.residual for _, b in group])
        return Message(unit, tensors, tensors, before, payload, None, rounds, after)

    def exchange(self, bucket: list[Message], collective: Collective) -> tf.Tensor:
        """Drive the bucket's protocols in lockstep: each round, one collective call per kind
        carries every unit's transfer of that kind. Fills each message's ``update`` and
        completes its ``after`` memory; returns whether the tensors every replica shares are all
        finite (every replica computes the same answer)."""
        pending = {i: next(m.protocol) for i, m in enumerate(bucket)}
        shared: list[tf.Tensor] = []
        while pending:
            received: dict[int, tuple[tf.Tensor, ...]] = {}
            for kind in (SUM, GATHER, GATHER_ROWS, ALL_TO_ALL):
                items = [(i, t) for i, t in pending.items() if t.kind == kind]
                if items:
                    received.update(_transfer(collective, kind, items))
            for i in list(pending):
                try:
                    pending[i] = bucket[i].protocol.send(received[i])
                except StopIteration as done:
                    del pending[i]
                    outcome: Outcome = done.value
                    m = bucket[i]
                    m.update = outcome.update
                    residual = outcome.remainder if m.after.residual is None else m.after.residual
                    m.after = m.after._replace(residual=residual, compressor_state=outcome.state)
                    shared += [t for t in outcome.shared if t.dtype.is_floating]
        checks = [_all_finite(t) for t in shared]
        return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)

    def measure(
        self,
        units: Sequence[Unit],
        messages: Sequence[Message],
        flag: tf.Tensor | bool,
        iteration: tf.Tensor,
        replica_id: tf.Tensor,
    ) -> tf.Tensor:
        """``[len(units), 5]`` stats rows of this replica, computed only when ``flag`` is True
        (zeros otherwise; zeros too for a unit none of whose variables had a gradient)."""
        width = len(STAT_NAMES)
        by_unit = {_planned(units, m.unit).indices: m for m in messages}

        def compute() -> tf.Tensor:
            rows = []
            for planned in units:
                m = by_unit.get(planned.indices)
                if m is None:
                    rows.append(tf.zeros([width], tf.float64))
                    continue
                compressor = m.unit.compressor
                acc = m.x if m.before.residual is None else m.x + m.before.residual
                error = m.after.residual
                if not isinstance(compressor, Codec):  # no local payload: the residual only
                    error = tf.zeros_like(acc) if error is None else error
                    rows.append(unit_stats(m.grad, acc, error, tf.zeros_like(m.grad)))
                    continue
                if error is None:
                    error = acc - compressor.decompress(m.payload, m.ctx)
                if compressor.is_identity:
                    grad_error = tf.zeros_like(m.grad)
                else:  # the same compressor on the fresh gradient alone
                    tensor_id = m.unit.indices[0]
                    fresh, fresh_ctx = compressor.compress(m.grad, iteration, tensor_id, replica_id)
                    grad_error = m.grad - compressor.decompress(fresh, fresh_ctx)
                rows.append(unit_stats(m.grad, acc, error, grad_error))
            return tf.stack(rows) if rows else tf.zeros([0, width], tf.float64)

        def skip() -> tf.Tensor:
            return tf.zeros([len(units), width], tf.float64)

        return tf.cond(tf.convert_to_tensor(flag, tf.bool), compute, skip)

    def get_config(self) -> dict:
        return {"compressor": serialize(self.compressor), **self.options.get_config()}


def bytes_per_step(units: Sequence[Unit]) -> tuple[int, int]:
    """``(wire bytes, dense bytes)`` one replica sends per step for these messages."""
    return sum(u.wire_bytes for u in units), sum(u.dense_bytes for u in units)


def _sent_bytes(messages: Sequence[Message]) -> tuple[int | tf.Tensor, int]:
    """``(wire bytes, dense bytes)`` this replica sent in a step; a unit sent as rows counts
    the bytes of its payload (they depend on the rows touched)."""
    as_rows = [m for m in messages if isinstance(m.grad, tf.IndexedSlices)]
    planned = [m.unit for m in messages if not isinstance(m.grad, tf.IndexedSlices)]
    measured = [sparse_rows.wire_bytes(m.payload) for m in as_rows]
    wire = bytes_per_step(planned)[0]
    dense = bytes_per_step([m.unit for m in messages])[1]
    return (wire + tf.add_n(measured) if measured else wire), dense


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


def _in_buckets(units: list[Unit], bucket_bytes: int) -> list[Unit]:
    """``units`` (in variable order) with buckets assigned in backprop order (the last
    variables' gradients are computed first): as in PyTorch DDP, a bucket is closed once it
    holds ``bucket_bytes`` of dense gradient or more."""
    bucket, filled, placed = 0, 0, {}
    for unit in sorted(units, key=lambda u: -max(u.indices)):
        placed[unit.indices] = dataclasses.replace(unit, bucket=bucket)
        filled += unit.dense_bytes
        if filled >= bucket_bytes:
            bucket, filled = bucket + 1, 0
    return [placed[u.indices] for u in sorted(units, key=lambda u: u.indices[0])]


def _per_variable(
    messages: list[Message], count: int, per_replica: bool
) -> dict[str, list[tf.Tensor | None]]:
    """Per-variable ``update``, ``residual`` and ``momentum`` lists from the messages' joined
    tensors (``None`` where a variable had none)."""
    out = {key: [None] * count for key in ("update", "residual", "momentum")}
    for m in messages:
        indices, shapes = m.unit.indices, m.unit.shapes
        joined = {"update": m.update, "residual": m.after.residual, "momentum": m.after.momentum}
        for key, tensor in joined.items():
            if tensor is not None:
                lead = int(per_replica) if key == "update" else 0
                for i, part in zip(indices, _split(tensor, shapes, lead), strict=True):
                    out[key][i] = part
    return out


def _transfer(
    collective: Collective, kind: str, items: list[tuple[int, Transfer]]
) -> dict[int, tuple[tf.Tensor, ...]]:
    """One collective call of ``kind`` for every unit's transfer; results by unit."""
    tensors = [t for _, transfer in items for t in transfer.tensors]
    if kind == SUM:
        results = iter(collective.all_reduce_sum(tensors))
    elif kind == GATHER:
        results = iter(collective.all_gather(tensors))
    elif kind == GATHER_ROWS:
        results = iter(collective.all_gather_rows(tensors))
    else:
        splits = [transfer.splits for _, transfer in items for _ in transfer.tensors]
        results = iter(collective.all_to_all(tensors, splits))
    return {i: tuple(next(results) for _ in transfer.tensors) for i, transfer in items}


def _joined(tensors: Sequence[tf.Tensor | None] | None, indices: tuple[int, ...]) -> tf.Tensor:
    """The tensors of a unit's variables, joined."""
    return _join([tensors[i] for i in indices])


def _residual(residuals: Sequence[Any], unit: Unit, rows: frozenset[int]) -> Any:
    """A unit's residual: its variable as given for a unit sent as rows (only the touched
    rows are read, :func:`tf_sparsify.core.replica_values.read_rows`), else its value."""
    if unit.indices[0] in rows:
        return residuals[unit.indices[0]]
    return _join([tf.convert_to_tensor(residuals[i]) for i in unit.indices])


def _join(tensors: list[tf.Tensor]) -> tf.Tensor:
    """One tensor as it is, several flattened and concatenated."""
    if len(tensors) == 1:
        return tensors[0]
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)


def _split(
    tensor: tf.Tensor, shapes: tuple[tf.TensorShape, ...], leading: int = 0
) -> list[tf.Tensor]:
    """Inverse of :func:`_join`, on the axes after the first ``leading`` ones (a list, a
    packed message's tensors, is already split)."""
    if isinstance(tensor, list):
        return tensor
    if len(shapes) == 1:
        return [tensor]
    parts = tf.split(tensor, [s.num_elements() for s in shapes], axis=leading)
    lead = tensor.shape[:leading]
    return [tf.reshape(p, lead.concatenate(s)) for p, s in zip(parts, shapes, strict=True)]


def _all_finite(t: tf.Tensor) -> tf.Tensor:
    return tf.reduce_all(tf.math.is_finite(t))
