"""``CompressionState``: the per-replica state of a gradient exchange, and its one update rule.

Every front end (the Keras wrapper, Horovod's ``DistributedOptimizer`` and
``GradientExchange``, ``ServerOptimizer``) keeps the same state: error-feedback residuals, DGC
momentum buffers, the step counter that keys random choices, byte counters, and the diagnostics
and gradient-norm records. This class holds those variables and writes each step's result back
by the rules of :mod:`tf_sparsify.compressors.error_memory` (residuals and momenta only when the
step was finite on every replica); the counters advance by what was actually sent. Front ends
say only how a variable is made (``make_variable``) and how payloads travel (a
:class:`~tf_sparsify.core.transport.Transport`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tf_sparsify.collectives import Collective
from tf_sparsify.compat import moved_names
from tf_sparsify.compressors.base import deserialize
from tf_sparsify.core import late, replica_values
from tf_sparsify.core.checkpoint import StateCheckpoint
from tf_sparsify.core.checkpoint_manifest import Entry
from tf_sparsify.core.measurements import STAT_NAMES
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.plan import Unit, bytes_per_step
from tf_sparsify.core.state_kinds import StateKind, VariableFactory
from tf_sparsify.core.step import GradientKind, StepFlags, StepMemory, StepResult
from tf_sparsify.core.step_records import (
    DIAGNOSTICS,
    GRAD_SQ_NORMS,
    StepRecord,
    grad_sq_norms,
)
from tf_sparsify.core.transport import Transport


class CompressionState:
    """Residuals, momenta, step, byte counters and records of one list of variables.

    Args:
        pipeline: what a step does with the gradients.
        make_variable: the front end's way to make (and track) a zero variable.
        transport: how payloads travel (``None``: tf.distribute's replica context, or one
            replica). With simulated workers (``transport.simulated_workers = P``) buffers get a
            leading axis of ``P`` and :meth:`run` takes gradients stacked as ``[P, *shape]``.
        step: a counter variable to use as the step (the Keras optimizer's own iterations);
            ``None`` makes one named ``"step"`` when built.
        also_saved: the front end's own variables to save in the state's checkpoint entry,
            as :class:`~tf_sparsify.core.checkpoint.Entry` records (a Keras optimizer's, so a
            restore is atomic).
    """

    def __init__(
        self,
        pipeline: GradientPipeline,
        make_variable: VariableFactory,
        transport: Transport | None = None,
        step=None,
        also_saved: Callable[[], list[Entry]] | None = None,
    ):
        self.transport = Transport() if transport is None else transport
        self.transport.check(pipeline)
        self.pipeline = pipeline
        self._make = make_variable
        self.step = step
        self.workers = self.transport.simulated_workers
        self.units: list[Unit] = []
        self.residuals: list = []
        self.momenta: list = []
        #: per variable, the gradient of the last step still to travel (late units only)
        self.in_flight: list = []
        #: which variables travel one step late (:mod:`tf_sparsify.core.late`)
        self.late: list[bool] = []
        #: per planned unit, the variables of its compressor's state (custom exchanges)
        self.states: list[tuple] = []
        self.names: tuple[str, ...] = ()
        self.bytes_sent = self.dense_bytes = None
        #: the diagnostics (:mod:`~tf_sparsify.core.measurements`) and each unit's ``||g||^2``
        self.diagnostics = StepRecord(DIAGNOSTICS, len(STAT_NAMES))
        self.grad_sq_norms = StepRecord(GRAD_SQ_NORMS, 1)
        #: every variable made, in order (what checkpoints hold)
        self.saved: list[Entry] = []
        self._also_saved = also_saved or (lambda: [])
        #: the checkpoint entry of this state (front ends track it)
        self.checkpoint = StateCheckpoint(self)

    @property
    def built(self) -> bool:
        return self.bytes_sent is not None

    def new_variable(
        self, key: str, shape, dtype, kind: StateKind, name: str | None = None, about: str = ""
    ):
        """A zero variable named ``name`` (``key`` by default), saved in checkpoints under
        ``key``; ``about`` names what it belongs to (a model variable's path) in messages."""
        variable = self._make(name or key, shape, dtype, kind)
        self.saved.append(Entry(key, variable, kind, about))
        return variable

    def saved_entries(self) -> list[Entry]:
        """What the checkpoint entry holds: the front end's variables, then the state's."""
        return self._also_saved() + self.saved

    def config(self) -> dict:
        """The configuration a checkpoint records (compressor and options, as JSON values)."""
        return json.loads(json.dumps(self.pipeline.get_config(), sort_keys=True, default=str))

    @property
    def gives_sparse_updates(self) -> bool:
        """Whether :meth:`run` can return :class:`~tf_sparsify.core.pipeline.SparseUpdate`
        updates."""
        return not self.transport.mean_only

    def collective(self, grads: Sequence | None = None, flush: bool = False) -> Collective:
        """The transport's collective for a step on ``grads`` (``None``: every variable has
        a dense gradient); ``flush``: the step applies what is in flight."""
        present = None if grads is None else tuple(GradientKind.of(g) for g in grads)
        if flush:  # a transport written before ``flush`` existed is still called as it was
            return self.transport.collective(self.pipeline, self.units, present, flush=True)
        return self.transport.collective(self.pipeline, self.units, present)

    # -- state --------------------------------------------------------------------------------
    def build(self, variables: Sequence) -> None:
        """Plan the messages for ``variables`` (in the transport's layout) and make their
        buffers and counters (inside the scope of the variables' strategy)."""
        replica_values.check_in_scope(variables)
        self.transport.build()
        variables = self.transport.layout(variables)
        names = [_path(v) for v in variables]
        leaves = [_leaf(v.name) for v in variables]
        self.units, self.names = plan_for(self.pipeline, variables)
        lead = () if self.workers is None else (self.workers,)

        def buffers(needs: list[bool], slot: str) -> list:
            return per_variable_buffers(self.new_variable, needs, slot, lead, variables, names)

        self.residuals = buffers(
            self.pipeline.needs_residual(self.units, len(variables)), "residual"
        )
        self.momenta = buffers(self.pipeline.needs_momentum(self.units, len(variables)), "momentum")
        self.late = late.late_variables(
            self.units, len(variables), self.pipeline.options.late_buckets
        )
        self.in_flight = buffers(self.late, "in_flight")
        self.states = [
            tuple(
                self.new_variable(
                    f"compressor_state/{n}/{j}",
                    tuple(shape),
                    dtype,
                    StateKind.REPLICATED,
                    f"{leaves[u.indices[0]]}_state{j}",
                    name,
                )
                for j, (shape, dtype) in enumerate(u.compressor.state_specs(u.shapes[0], u.dtype))
            )
            for n, (u, name) in enumerate(zip(self.units, self.names, strict=True))
        ]
        if self.step is None:
            self.step = self.new_variable("step", (), tf.int64, StateKind.SHARED)
        self.bytes_sent = self.new_variable("bytes_sent", (), tf.int64, StateKind.SHARED)
        self.dense_bytes = self.new_variable("dense_bytes", (), tf.int64, StateKind.SHARED)
        for record in (self.diagnostics, self.grad_sq_norms):
            record.build(self.new_variable, len(self.units))

    def enable_record(self, record: StepRecord, name: str, every: int) -> None:
        """Write ``record`` every ``every`` steps (0: off; ``name`` is the argument in errors);
        makes its variables when built (call it under the strategy scope the state was built
        in)."""
        record.enable(name, every)
        if self.built:
            record.build(self.new_variable, len(self.units))

    def set_pipeline(self, pipeline: GradientPipeline, variables: Sequence | None = None) -> None:
        """Use ``pipeline`` from now on; when built, it is planned for the same variables (the
        planned ones unless ``variables`` are given) and must need the same buffers, which
        carry over."""
        self.transport.check(pipeline)
        if self.built:
            if variables is None:
                units, names = replanned(pipeline, self.units, self.names)
            else:
                units, names = plan_for(pipeline, self.transport.layout(variables))
            n = sum(len(u.indices) for u in units)
            if pipeline.needs_residual(units, n) != self.pipeline.needs_residual(self.units, n):
                raise ValueError(
                    f"compressor={pipeline.compressor!r} needs other residual buffers than the "
                    "state was built with."
                )
            self.units, self.names = units, names
        self.pipeline = pipeline

    def adopt_decisions(self, saved_config: dict) -> None:
        """Take the settings an adaptive compressor had decided when a checkpoint was written
        (``Compressor.without_decisions``: they are state, restored with the residuals)."""
        saved = deserialize(saved_config["compressor"])
        current = self.pipeline.compressor
        if saved != current and saved.without_decisions() == current.without_decisions():
            self.set_pipeline(self.pipeline.with_compressor(saved))

    @property
    def bytes_per_step(self) -> tuple[int, int]:
        """``(wire, dense)`` bytes of a step in which every variable has a gradient."""
        return bytes_per_step(self.units)

    # -- one step -----------------------------------------------------------------------------
    def run(
        self,
        grads: Sequence,
        collective: Collective,
        per_replica: bool = False,
        finish: Callable[[StepResult], StepResult] | None = None,
        sparse_updates: bool = False,
    ) -> StepResult:
        """One step: exchange ``grads`` (build order), then update the state.

        ``per_replica``: every replica's (or simulated worker's) contribution is returned
        along a leading axis (for delayed updates and IAG). ``finish``: what a front end does
        with the step's result before the state is written (its updates and ``finite`` count).
        ``sparse_updates``: see :class:`~tf_sparsify.core.step.StepFlags`. The collective's
        layout turns ``grads`` into the planned layout and the updates back.
        """
        if self.transport.mean_only and (per_replica or finish is not None or sparse_updates):
            raise ValueError(
                f"{type(self.transport).__name__} returns the averaged dense update only."
            )
        grads = collective.layout.to_layout(list(grads))
        record = self.diagnostics.due(self.step)
        norms_due = self.grad_sq_norms.due(self.step)
        norms = None if norms_due is None else grad_sq_norms(self.units, grads, norms_due)
        memory = StepMemory(
            self.residuals,  # read by the routes: a unit sent as rows reads its rows only
            self.step,
            replica_values.current_values(self.momenta)
            if self.pipeline.options.momentum_correction
            else None,
            [replica_values.current_values(s) for s in self.states],
        )
        flags = StepFlags(record, per_replica, sparse_updates)
        if any(self.late):
            result = late.run_late_then_now(self, grads, memory, collective, flags)
        else:
            result = self.transport.run_pipeline(
                self.pipeline, self.units, grads, memory, collective, flags
            )
        updates, finite = collective.layout.from_layout(result.updates, result.finite)
        result = dataclasses.replace(result, updates=updates, finite=finite)
        if finish is not None:
            result = finish(result)
        self._write_back(result)
        self.diagnostics.write(record, result.stats, self.step)
        self.grad_sq_norms.write(norms_due, norms, self.step)
        self.step.assign_add(1)
        return result

    def _write_back(self, result: StepResult) -> None:
        """Buffers only when the step was finite everywhere; counters always."""
        buffers = [(self.residuals, result.residuals), (self.momenta, result.momenta)]
        pairs = [
            (variable, new)
            for variables, news in buffers
            if news is not None
            for variable, new in zip(variables, news, strict=True)
            if variable is not None and new is not None
        ]
        for variables, news in zip(self.states, result.states or [], strict=False):
            if news:
                pairs += list(zip(variables, news, strict=True))
        store_if_finite(pairs, result.finite)
        self.bytes_sent.assign_add(result.sent_bytes[0])
        self.dense_bytes.assign_add(result.sent_bytes[1])


def per_variable_buffers(
    new_variable: Callable, needs: Sequence[bool], slot: str, lead: tuple, variables, names
) -> list:
    """A zero buffer (per replica) like each variable that ``needs`` one, else None."""
    return [
        new_variable(
            f"{slot}/{i}",
            lead + tuple(v.shape),
            tf.as_dtype(v.dtype),
            StateKind.PER_REPLICA,
            f"{_leaf(v.name)}_{slot}",
            names[i],
        )
        if need
        else None
        for i, (v, need) in enumerate(zip(variables, needs, strict=True))
    ]


def plan_for(pipeline: GradientPipeline, variables: Sequence) -> tuple[list[Unit], tuple[str, ...]]:
    """``pipeline``'s units for ``variables`` (in the transport's layout), and their names."""
    shapes = [tf.TensorShape(v.shape) for v in variables]
    units = pipeline.plan(shapes, [tf.as_dtype(v.dtype) for v in variables])
    paths = [_path(v) for v in variables]
    return units, tuple(_unit_name(u, paths) for u in units)


def replanned(
    pipeline: GradientPipeline, units: Sequence[Unit], names: Sequence[str]
) -> tuple[list[Unit], tuple[str, ...]]:
    """``pipeline``'s units for the variables ``units`` were planned for, named as before."""
    planned = {i: (s, u.dtype) for u in units for i, s in zip(u.indices, u.shapes, strict=True)}
    shapes, dtypes = zip(*(planned[i] for i in range(len(planned))), strict=True)
    new = pipeline.plan(list(shapes), list(dtypes))
    by_indices = dict(zip((u.indices for u in units), names, strict=True))
    return new, tuple(by_indices[u.indices] for u in new)


def _path(variable) -> str:
    return getattr(variable, "path", None) or variable.name


def _leaf(name: str) -> str:
    """A variable's name usable in another variable's name (``tf.Variable`` names have
    scopes and ``:0``)."""
    return name.replace("/", "_").replace(":", "_")


def _unit_name(unit: Unit, names: Sequence[str]) -> str:
    """The variable's path for a one-variable message, ``global_<dtype>`` for a group."""
    if len(unit.indices) == 1:
        return names[unit.indices[0]]
    return f"global_{unit.dtype.name}"


#: names this module had before the core was split (kept one release)
__getattr__ = moved_names(__name__, {"StateViews": "tf_sparsify.core.state_views"})


def store_if_finite(pairs: Sequence[tuple[Any, tf.Tensor]], finite: tf.Tensor) -> None:
    """Assign each ``(variable, new value)`` pair only when ``finite`` (the step was finite on
    every replica): a bad step leaves the memory as it was (rule 4 of
    :mod:`tf_sparsify.compressors.error_memory`). A value given as ``tf.IndexedSlices`` writes
    only its rows (a sparse gradient's touched rows)."""
    if not pairs:
        return

    def store() -> tf.Tensor:
        for variable, value in pairs:
            if isinstance(value, tf.IndexedSlices):
                replica_values.write_rows(variable, value)
            else:
                variable.assign(value)
        return tf.constant(True)

    tf.cond(finite, store, lambda: tf.constant(False))
