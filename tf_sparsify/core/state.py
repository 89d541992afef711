"""``CompressionState``: the per-replica state of a gradient exchange, and its one update rule.

Every front end (the Keras wrapper, Horovod's ``DistributedOptimizer`` and
``GradientExchange``, ``ServerOptimizer``) keeps the same state: error-feedback residuals, DGC
momentum buffers, the step counter that keys random choices, byte counters and the diagnostics
record. This class holds those variables and writes each step's result back by the rules of
:mod:`tf_sparsify.compressors.error_memory` (residuals and momenta only when the step was finite on
every
replica); the counters advance by what was actually sent. Front ends say only how a variable is made
(``make_variable``) and how payloads travel (a :class:`~tf_sparsify.core.transport.Transport`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

import tensorflow as tf

from tf_sparsify.collectives.base import Collective, SimulatedWorkerCollective
from tf_sparsify.common.checks import check_int
from tf_sparsify.compressors import error_memory as memory
from tf_sparsify.compressors.base import MultiRoundMethod
from tf_sparsify.core import replica_values
from tf_sparsify.core.checkpoint import Entry, StateCheckpoint
from tf_sparsify.core.measurements import STAT_NAMES
from tf_sparsify.core.pipeline import GradientPipeline, StepResult, Unit, bytes_per_step
from tf_sparsify.core.transport import Transport


class CompressionState:
    """Residuals, momenta, step, byte counters and diagnostics of one list of variables.

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
        make_variable: memory.VariableFactory,
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
        #: per planned unit, the variables of its compressor's state (custom exchanges)
        self.states: list[tuple] = []
        self.names: tuple[str, ...] = ()
        self.bytes_sent = self.dense_bytes = None
        self.diagnostics = self.diagnostics_step = None
        self.diagnostics_every = 0
        #: every variable made, in order (what checkpoints hold)
        self.saved: list[Entry] = []
        self._also_saved = also_saved or (lambda: [])
        #: the checkpoint entry of this state (front ends track it)
        self.checkpoint = StateCheckpoint(
            entries=lambda: self._also_saved() + self.saved,
            config=self._config,
            rows=self.transport.checkpoint_rows,
            built=lambda: self.built,
            step=lambda: self.step,
            gather=self.transport.gather_rows_when_saving,
        )

    @property
    def built(self) -> bool:
        return self.bytes_sent is not None

    def new_variable(
        self, key: str, shape, dtype, kind: str, name: str | None = None, about: str = ""
    ):
        """A zero variable named ``name`` (``key`` by default), saved in checkpoints under
        ``key``; ``about`` names what it belongs to (a model variable's path) in messages."""
        variable = self._make(name or key, shape, dtype, kind)
        self.saved.append(Entry(key, variable, kind, about))
        return variable

    def _config(self) -> dict:
        """The configuration a checkpoint records (compressor and options, as JSON values)."""
        return json.loads(json.dumps(self.pipeline.get_config(), sort_keys=True, default=str))

    @property
    def gives_sparse_updates(self) -> bool:
        """Whether :meth:`run` can return :class:`~tf_sparsify.core.pipeline.SparseUpdate`
        updates."""
        return not self.transport.mean_only

    def collective(self, grads: Sequence | None = None) -> Collective:
        """The transport's collective for a step on ``grads`` (``None``: every variable has
        a dense gradient)."""
        present = None if grads is None else tuple(gradient_kind(g) for g in grads)
        return self.transport.collective(self.pipeline, self.units, present)

    # -- state --------------------------------------------------------------------------------
    def build(self, variables: Sequence) -> None:
        """Plan the messages for ``variables`` (in the transport's layout) and make their
        buffers and counters (inside the scope of the variables' strategy)."""
        replica_values.check_in_scope(variables)
        self.transport.build()
        variables = self.transport.layout(variables)
        shapes = [tf.TensorShape(v.shape) for v in variables]
        dtypes = [tf.as_dtype(v.dtype) for v in variables]
        names = [getattr(v, "path", None) or v.name for v in variables]
        leaves = [_leaf(v.name) for v in variables]
        self.units = self.pipeline.plan(shapes, dtypes)
        lead = () if self.workers is None else (self.workers,)

        def buffers(needs: list[bool], slot: str) -> list:
            return [
                self.new_variable(
                    f"{slot}/{i}", lead + tuple(s), d, "per_replica", f"{leaf}_{slot}", names[i]
                )
                if need
                else None
                for i, (leaf, s, d, need) in enumerate(
                    zip(leaves, shapes, dtypes, needs, strict=True)
                )
            ]

        self.residuals = buffers(
            self.pipeline.needs_residual(self.units, len(variables)), "residual"
        )
        self.momenta = buffers(self.pipeline.needs_momentum(self.units, len(variables)), "momentum")
        self.names = tuple(_unit_name(u, names) for u in self.units)
        self.states = [
            tuple(
                self.new_variable(
                    f"compressor_state/{n}/{j}",
                    tuple(shape),
                    dtype,
                    "replicated",
                    f"{leaves[u.indices[0]]}_state{j}",
                    name,
                )
                for j, (shape, dtype) in enumerate(u.compressor.state_specs(u.shapes[0], u.dtype))
            )
            for n, (u, name) in enumerate(zip(self.units, self.names, strict=True))
        ]
        if self.step is None:
            self.step = self.new_variable("step", (), tf.int64, "shared")
        self.bytes_sent = self.new_variable("bytes_sent", (), tf.int64, "shared")
        self.dense_bytes = self.new_variable("dense_bytes", (), tf.int64, "shared")
        if self.diagnostics_every:
            self._build_diagnostics()

    def enable_diagnostics(self, every: int) -> None:
        """Record the diagnostics every ``every`` steps (0: off); makes their variables when
        built (call it under the strategy scope the state was built in)."""
        self.diagnostics_every = check_int("diagnostics_every", every, minimum=0)
        if every and self.built:
            self._build_diagnostics()

    def _build_diagnostics(self) -> None:
        if self.diagnostics is None:
            width = len(STAT_NAMES)
            shape = (len(self.units), width)
            self.diagnostics = self.new_variable(
                "diagnostics", shape, tf.float64, "per_replica_mean"
            )
            self.diagnostics_step = self.new_variable("diagnostics_step", (), tf.int64, "shared")

    def set_pipeline(self, pipeline: GradientPipeline, variables: Sequence | None) -> None:
        """Use ``pipeline`` from now on; when built (``variables`` given), its plan must need
        the same buffers, which carry over."""
        self.transport.check(pipeline)
        if variables is not None and self.built:
            variables = self.transport.layout(variables)
            shapes = [tf.TensorShape(v.shape) for v in variables]
            units = pipeline.plan(shapes, [tf.as_dtype(v.dtype) for v in variables])
            n = len(variables)
            if pipeline.needs_residual(units, n) != self.pipeline.needs_residual(self.units, n):
                raise ValueError(
                    f"compressor={pipeline.compressor!r} needs other residual buffers than the "
                    "state was built with."
                )
            self.units = units
            names = [getattr(v, "path", None) or v.name for v in variables]
            self.names = tuple(_unit_name(u, names) for u in units)
        self.pipeline = pipeline

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
        ``sparse_updates``: see :meth:`GradientPipeline.run_step` (not for simulated workers).
        ``collective`` turns ``grads`` into the transport's layout and the result back.
        """
        if self.transport.mean_only and (per_replica or finish is not None or sparse_updates):
            raise ValueError(
                f"{type(self.transport).__name__} returns the averaged dense update only."
            )
        grads = collective.enter(list(grads))
        record = None
        if self.diagnostics is not None:
            record = tf.equal(self.step % self.diagnostics_every, 0)
        if self.workers is None:
            result = self.pipeline.run_step(
                self.units,
                grads,
                self.residuals,  # read by the pipeline: a unit sent as rows reads its rows only
                self.step,
                collective,
                momenta=_values(self.momenta) if self.pipeline.momentum_correction else None,
                measure=record,
                per_replica=per_replica,
                states=[_values(list(s)) for s in self.states],
                sparse_updates=sparse_updates,
            )
        else:
            result = self._run_workers(grads, record)
        result = collective.leave(result)
        if finish is not None:
            result = finish(result)
        self._write_back(result, record)
        return result

    def _run_workers(self, grads: list, record) -> StepResult:
        """The pipeline once per simulated worker, each with its row of the buffers."""
        if any(isinstance(u.compressor, MultiRoundMethod) for u in self.units):
            raise ValueError(
                f"compressor={self.pipeline.compressor!r} runs its own exchange, which simulated "
                "workers cannot split per worker."
            )
        for g in grads:
            if g is not None and g.shape[0] != self.workers:
                raise ValueError(
                    f"With workers={self.workers}, gradients must be stacked per worker "
                    f"([{self.workers}, ...]); received a gradient of shape {tuple(g.shape)}."
                )
        residuals, momenta = _values(self.residuals), _values(self.momenta)
        use_momenta = self.pipeline.momentum_correction > 0
        parts = [
            self.pipeline.run_step(
                self.units,
                _row(grads, p),
                _row(residuals, p),
                self.step,
                SimulatedWorkerCollective(p, self.workers),
                momenta=_row(momenta, p) if use_momenta else None,
                measure=record,
                per_replica=True,
            )
            for p in range(self.workers)
        ]
        return _stack_workers(parts)

    def _write_back(self, result: StepResult, record) -> None:
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
        memory.store_if_finite(pairs, result.finite)
        if record is not None:
            self.diagnostics.assign(
                tf.where(record, result.stats, tf.convert_to_tensor(self.diagnostics))
            )
            done = tf.cast(self.step + 1, tf.int64)
            previous = tf.convert_to_tensor(self.diagnostics_step)
            self.diagnostics_step.assign(tf.where(record, done, previous))
        self.bytes_sent.assign_add(result.sent_bytes[0])
        self.dense_bytes.assign_add(result.sent_bytes[1])
        self.step.assign_add(1)


class StateViews:
    """Read-only views of an ``CompressionState`` held as ``self._state``, shared by the front
    ends (the Keras optimizers and Horovod's ``GradientExchange``)."""

    _state: CompressionState

    @property
    def exchange_checkpoint(self) -> StateCheckpoint:
        """The checkpoint entry of the exchange state (every replica's rows, checked before
        a restore assigns anything; see :mod:`tf_sparsify.core.checkpoint`)."""
        return self._state.checkpoint

    @property
    def units(self) -> list[Unit]:
        """The planned messages (:class:`~tf_sparsify.core.pipeline.Unit`) of one step."""
        return list(self._state.units)

    @property
    def residuals(self) -> list:
        """The residual variable of each variable (``None`` where there is none)."""
        return list(self._state.residuals)

    @property
    def momenta(self) -> list:
        """The momentum buffer of each variable (momentum correction), or ``None``."""
        return list(self._state.momenta)

    @property
    def exchange_steps(self):
        """The number of exchanges done (it keys random choices)."""
        return self._state.step

    @property
    def bytes_sent(self):
        """Payload bytes this replica sent, summed over steps."""
        return self._state.bytes_sent

    @property
    def dense_bytes(self):
        """What the same steps would have sent uncompressed."""
        return self._state.dense_bytes

    @property
    def wire_bytes_per_step(self) -> int:
        """Payload bytes of a step in which every variable has a gradient."""
        return self._state.bytes_per_step[0]

    @property
    def dense_bytes_per_step(self) -> int:
        return self._state.bytes_per_step[1]

    @property
    def diagnostics(self):
        """The ``[units, 5]`` diagnostics record (``None`` until enabled and built); rows follow
        :attr:`diagnostics_names`, columns :data:`~tf_sparsify.core.measurements.STAT_NAMES`."""
        return self._state.diagnostics

    @property
    def diagnostics_step(self):
        """The number of steps done when the diagnostics were last recorded (0: never)."""
        return self._state.diagnostics_step

    @property
    def diagnostics_names(self) -> tuple[str, ...]:
        """The name of each planned message: the variable's path, or ``global_<dtype>``."""
        return self._state.names


def gradient_kind(grad) -> bool | str:
    """What a transport's ``present`` holds for a gradient: ``False`` (none), ``True`` (dense)
    or ``"rows"`` (``tf.IndexedSlices``, which may travel as rows)."""
    if grad is None:
        return False
    return "rows" if isinstance(grad, tf.IndexedSlices) else True


def _leaf(name: str) -> str:
    """A variable's name usable in another variable's name (``tf.Variable`` names have
    scopes and ``:0``)."""
    return name.replace("/", "_").replace(":", "_")


def _unit_name(unit: Unit, names: Sequence[str]) -> str:
    """The variable's path for a one-variable message, ``global_<dtype>`` for a group."""
    if len(unit.indices) == 1:
        return names[unit.indices[0]]
    return f"global_{unit.dtype.name}"


def _values(variables: list) -> list:
    """The current value of each variable (this replica's copy), ``None`` kept."""
    return [None if v is None else tf.convert_to_tensor(v) for v in variables]


def _row(tensors: list, p: int) -> list:
    return [None if t is None else tf.convert_to_tensor(t)[p] for t in tensors]


def _stack_workers(parts: list[StepResult]) -> StepResult:
    """One StepResult for all simulated workers: contributions ``[P, ...]``, buffers stacked."""

    def join(lists, combine):
        return [
            None if column[0] is None else combine(list(column))
            for column in zip(*lists, strict=True)
        ]

    first = parts[0]
    stats = None
    if first.stats is not None:
        stats = tf.reduce_mean(tf.stack([r.stats for r in parts]), axis=0)
    return dataclasses.replace(
        first,
        updates=join([r.updates for r in parts], lambda ts: tf.concat(ts, axis=0)),
        residuals=join([r.residuals for r in parts], tf.stack),
        finite=tf.reduce_all(tf.stack([r.finite for r in parts])),
        momenta=None if first.momenta is None else join([r.momenta for r in parts], tf.stack),
        stats=stats,
    )
