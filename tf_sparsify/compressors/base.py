"""The compressor interface and the small helpers every compressor shares."""

from __future__ import annotations

import abc
import fractions
import numbers
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.common.checks import check_float_dtype, is_number
from tf_sparsify.common.registry import Registry
from tf_sparsify.compressors import error_memory
from tf_sparsify.compressors.rounds import Started, entries_round, one_round, scaled
from tf_sparsify.ops import xla

Payload = tuple[tf.Tensor, ...]

if TYPE_CHECKING:
    from tf_sparsify.compressors.error_memory import UnitMemory
    from tf_sparsify.compressors.rounds import ReplicaGroup, Rounds


class Context:
    """What a receiver knows besides the payload: shape, dtype, and the RNG keys of the step.

    Every replica compresses the same tensor at the same step, so a receiver can rebuild
    shared random choices (RandomK's indices) from ``step`` and ``tensor_id``.
    """

    __slots__ = ("shape", "dtype", "step", "tensor_id")

    def __init__(
        self, shape: tf.TensorShape, dtype: tf.DType, step: tf.Tensor | int = 0, tensor_id: int = 0
    ):
        self.shape = tf.TensorShape(shape)
        self.dtype = tf.as_dtype(dtype)
        self.step = step
        self.tensor_id = tensor_id

    @property
    def num_elements(self) -> int:
        return self.shape.num_elements()


class Compressor(abc.ABC):
    """What every way of sending a gradient shares: its promises, its bytes, its config.

    Two kinds implement it. A :class:`Codec` is a single-round compressor (TopK, QSGD,
    TernGrad, RandomK, ScaledSign, the casts, Identity): ``compress(tensor) -> (payload,
    ctx)``, ``decompress(payload, ctx)``, and the pipeline moves its payload in one round (by
    all-reduce when ``summable``, else by all-gather). A :class:`MultiRoundMethod` runs its
    own protocol of several rounds or other collectives (PowerSGD, SparseAllReduce). Either
    way the pipeline asks it to :meth:`start` a unit's exchange and drives the protocol it
    returns (:mod:`tf_sparsify.compressors.rounds`). Subclasses set the flags below.
    """

    unbiased: ClassVar[bool] = False
    summable: ClassVar[bool] = False
    randomized: ClassVar[bool] = False
    #: the payload is the tensor itself (nothing to decode, no error)
    is_identity: ClassVar[bool] = False
    #: a non-finite input always makes a float tensor of the payload non-finite, so receivers
    #: see a bad step in the payload itself (the pipeline then needs no separate check)
    reveals_non_finite: ClassVar[bool] = False
    #: whether ``compress`` needs the tensor's size at trace time (the payload layout uses it)
    needs_static_shape: ClassVar[bool] = True
    #: the compressor works on each tensor's shape (PowerSGD: matrices), so it cannot take
    #: gradients joined into one flat vector (``scope="global"``)
    shape_aware: ClassVar[bool] = False
    #: error feedback is part of the compressor's published algorithm and its residual stays
    #: bounded without a contraction (see :func:`check_contraction`); off for every compressor
    #: that only the generic contraction argument covers
    error_feedback_by_design: ClassVar[bool] = False
    #: a payload is a set of (flat index, value) entries, each index once: gathered payloads
    #: give them as :meth:`gathered_entries` (so a plain SGD step can apply them in place)
    sends_entries: ClassVar[bool] = False
    #: ``compress_compensated(tensor, residual, step, tensor_id, replica_id)`` compresses
    #: ``tensor + residual`` and returns ``(payload, ctx, remainder)`` in one fused pass
    fuses_feedback: ClassVar[bool] = False
    #: every shape in the exchange is known when it is traced, so XLA (``jit_compile=True``)
    #: can compile a step that uses the compressor
    runs_under_xla: ClassVar[bool] = True

    #: capabilities the routes read (:mod:`tf_sparsify.core.routes`), declared by each class
    #: itself and not inherited (a subclass may change what it sends): a one-variable unit's
    #: ``IndexedSlices`` gradient may travel as its touched rows
    travels_as_rows: ClassVar[bool] = False
    #: one-variable units with error feedback may travel packed, one payload per bucket
    packs_in_buckets: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        COMPRESSORS.add(cls)
        for capability in ("travels_as_rows", "packs_in_buckets"):
            if capability not in cls.__dict__:
                setattr(cls, capability, False)

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        """Exact bytes of the payload for a tensor of ``num_elements`` entries of ``dtype``."""
        raise NotImplementedError

    def wire_bytes_for(self, shape: tf.TensorShape, dtype: tf.DType = tf.float32) -> int:
        """Exact bytes of the payload for a tensor of this ``shape``; shape-aware compressors
        override it, the others send :meth:`wire_bytes` of its size."""
        return self.wire_bytes(tf.TensorShape(shape).num_elements(), dtype)

    def state_specs(self, shape: tf.TensorShape, dtype: tf.DType) -> tuple[tuple, ...]:
        """``(shape, dtype)`` of each state tensor a custom exchange keeps for a tensor of this
        shape (checkpointed with the residuals; zeros at first)."""
        return ()

    def entries_sent(self, num_elements: int) -> int | None:
        """How many entries a payload carries for a tensor of ``num_elements``, when fixed."""
        return None

    def variance_bound(self, num_elements: int) -> float | None:
        """``beta`` with ``E||C(x) - x||^2 <= beta ||x||^2`` for an unbiased compressor."""
        return None

    def contraction(self, num_elements: int) -> float | None:
        """``delta`` in (0, 1] with ``E||x - C(x)||^2 <= (1 - delta) ||x||^2`` for every ``x``
        of ``num_elements`` entries, or ``None`` when there is no such ``delta``.

        Error feedback needs one: without it the residual can grow without bound. An unbiased
        compressor contracts with ``delta = 1 - beta`` when its variance bound ``beta < 1``.
        An empty tensor is sent exactly: ``delta = 1``.
        """
        beta = self.variance_bound(num_elements) if self.unbiased else None
        return None if beta is None or beta >= 1 else 1.0 - beta

    def for_unit(self, position: int, count: int) -> Compressor:
        """The compressor that sends compressed unit ``position`` of ``count`` (in variable
        order): this one, unless the compressor chooses per unit (``Auto``)."""
        return self

    def without_decisions(self) -> Compressor:
        """This compressor without what it decides while training (``Auto``'s levels): what
        a checkpoint's configuration must match; the decisions are restored as state."""
        return self

    def get_config(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Compressor:
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.get_config().items()))))

    @abc.abstractmethod
    def start(
        self,
        tensor: tf.Tensor,
        before: UnitMemory,
        iteration: tf.Tensor | int,
        tensor_id: int,
        replicas: ReplicaGroup,
        per_replica: bool,
        sparse_update: bool,
    ) -> Started:
        """Begin one unit's exchange of ``tensor`` (the gradient, or the momentum-corrected
        gradient) with its memory ``before``: what is sent first, what the replica keeps, and
        the protocol the pipeline drives from here. ``per_replica``: every replica's
        contribution is wanted (delayed updates, IAG); ``sparse_update``: the update may come
        as gathered entries (:class:`~tf_sparsify.compressors.rounds.SparseUpdate`)."""


#: every Compressor subclass, by name (for configs)
COMPRESSORS = Registry("compressor", Compressor)


class Codec(Compressor):
    """A single-round compressor: ``compress(tensor) -> (payload, ctx)``,
    ``decompress(payload, ctx)``; its payload travels in one round.

    Subclasses set ``unbiased``, ``summable`` and ``randomized`` and implement ``_compress``,
    ``_decompress`` and ``wire_bytes``. Random choices are drawn from stateless RNG keyed by
    ``(seed, step, tensor_id[, replica_id])``. A call without a step draws afresh: the n-th
    such call of a randomized compressor (n = 0, 1, ...) uses ``step=n``, counted by an int64
    ``tf.Variable`` that advances on every call, also inside a ``tf.function``; that counter is
    the only state besides the seed and is not part of the config.

    ``summable`` means payloads of several replicas can be added element-wise before
    ``decompress`` (decompression is linear in the payload and all replicas share the layout),
    so they travel by all-reduce; other payloads travel by all-gather.
    """

    _unkeyed_steps: tf.Variable | None = None

    # -- public interface -------------------------------------------------------------------
    def compress(
        self,
        tensor: tf.Tensor,
        step: tf.Tensor | int | None = None,
        tensor_id: int = 0,
        replica_id: tf.Tensor | int = 0,
    ) -> tuple[Payload, Context]:
        """Compress ``tensor``; the keys only matter for randomized compressors.

        ``step=None`` draws afresh on each call (see the class docstring); explicit keys
        reproduce a draw exactly.
        """
        tensor, ctx = self._context(tensor, step, tensor_id)
        return tuple(self._compress(tensor, ctx, replica_id)), ctx

    def decompress(self, payload: Payload, ctx: Context) -> tf.Tensor:
        """Rebuild a dense tensor of the original shape and dtype."""
        return self._decompress(tuple(payload), ctx)

    def compress_with_feedback(
        self,
        tensor: tf.Tensor,
        residual: tf.Tensor,
        step: tf.Tensor | int | None = None,
        tensor_id: int = 0,
        replica_id: tf.Tensor | int = 0,
    ) -> tuple[Payload, Context, tf.Tensor]:
        """Compress ``acc = tensor + residual``: ``(payload, ctx, acc - decompress(payload))``
        (rule 2 of :mod:`tf_sparsify.compressors.error_memory`), in one pass where the codec
        has a fused kernel (``fuses_feedback``)."""
        if self.fuses_feedback:
            return self.compress_compensated(tensor, residual, step, tensor_id, replica_id)
        acc = tf.convert_to_tensor(tensor) + residual
        payload, ctx = self.compress(acc, step, tensor_id, replica_id)
        return payload, ctx, acc - self.decompress(payload, ctx)

    def decompress_sum(self, gathered: Payload, ctx: Context, num_replicas: int) -> tf.Tensor:
        """Sum of the decompressed payloads of ``num_replicas`` replicas.

        ``gathered`` holds each payload tensor stacked along a new leading replica axis.
        """
        total = None
        for r in range(num_replicas):
            part = self.decompress(tuple(t[r] for t in gathered), ctx)
            total = part if total is None else total + part
        return total

    def decompress_scaled(
        self, summed: Payload, ctx: Context, divisor: float
    ) -> tuple[tf.Tensor, tuple[tf.Tensor, ...]]:
        """``decompress(summed, ctx) / divisor`` for a payload summed over replicas, and the
        tensors the pipeline checks to agree on a bad step (by default the payload itself)."""
        return scaled(self.decompress(summed, ctx), divisor), summed

    def gathered_entries(self, gathered: Payload, ctx: Context) -> tuple[tf.Tensor, tf.Tensor]:
        """``(values, indices)``, both ``[replicas, k]``, of payloads gathered as for
        :meth:`decompress_sum` (``sends_entries`` compressors): values in ``ctx.dtype``, each
        row's flat indices strictly ascending; their scatter-sum is the decompressed sum."""
        raise NotImplementedError(f"{type(self).__name__} does not send entries")

    def sent_mask(self, payload: Payload, ctx: Context) -> tf.Tensor:
        """1 where this payload carries an entry of the tensor, 0 elsewhere (``ctx``'s shape and
        dtype); by default where the decompressed payload is non-zero."""
        return tf.cast(tf.not_equal(self.decompress(payload, ctx), 0), ctx.dtype)

    # -- shared steps -----------------------------------------------------------------------
    def _context(
        self, tensor: tf.Tensor, step: tf.Tensor | int | None, tensor_id: int
    ) -> tuple[tf.Tensor, Context]:
        """Check ``tensor`` and build its context; ``step=None`` takes the next unkeyed step."""
        tensor = tf.convert_to_tensor(tensor)
        check_float_dtype("tensor", tensor.dtype)
        if self.needs_static_shape and not tensor.shape.is_fully_defined():
            raise ValueError(
                f"{type(self).__name__} needs a tensor of fully defined static shape (its size "
                f"sets the payload); received shape={tensor.shape}. Inside a tf.function, give "
                "an input_signature with a full shape."
            )
        if step is None:
            step = self._next_unkeyed_step() if self.randomized else 0
        return tensor, Context(tensor.shape, tensor.dtype, step, tensor_id)

    def _next_unkeyed_step(self) -> tf.Tensor:
        """0, 1, 2, ... on successive calls, eagerly and per execution of a tf.function."""
        if self._unkeyed_steps is None:
            with tf.init_scope():  # created once, outside any function being traced
                self._unkeyed_steps = tf.Variable(
                    0, dtype=tf.int64, trainable=False, name="unkeyed_steps"
                )
        return tf.identity(self._unkeyed_steps.assign_add(1)) - 1

    # -- to implement -----------------------------------------------------------------------
    @abc.abstractmethod
    def _compress(self, tensor: tf.Tensor, ctx: Context, replica_id) -> Payload:
        """The payload of ``tensor`` (checked, with its context)."""

    @abc.abstractmethod
    def _decompress(self, payload: Payload, ctx: Context) -> tf.Tensor:
        """The dense tensor a payload stands for."""

    def start(
        self,
        tensor: tf.Tensor,
        before: UnitMemory,
        iteration: tf.Tensor | int,
        tensor_id: int,
        replicas: ReplicaGroup,
        per_replica: bool,
        sparse_update: bool,
    ) -> Started:
        """Compress with the unit's memory (the rules of
        :mod:`tf_sparsify.compressors.error_memory`), then one
        round: the payload summed or gathered, decompressed and averaged (gathered entries with
        ``sparse_update`` when the codec sends entries)."""
        remainder = None
        if before.residual is not None:
            payload, ctx, remainder = self.compress_with_feedback(
                tensor, before.residual, iteration, tensor_id, replicas.replica_id
            )
        else:
            payload, ctx = self.compress(tensor, iteration, tensor_id, replicas.replica_id)
        with_momentum = before.momentum is not None
        after = error_memory.after_sending(
            tensor, remainder, lambda: self.sent_mask(payload, ctx), with_momentum
        )
        if not self.reveals_non_finite:
            payload = error_memory.mark_if_kept_non_finite(payload, after)
        if sparse_update and self.sends_entries and not per_replica:
            rounds = entries_round(self, payload, ctx, replicas)
        else:
            rounds = one_round(self, payload, ctx, replicas, per_replica)
        return Started(rounds, ctx, payload, after)


class MultiRoundMethod(Compressor):
    """A method that runs its own exchange: several rounds or other collectives (PowerSGD's
    two all-reduces, the sparse all-reduce's all-to-all and all-gather). Subclasses implement
    :meth:`rounds`; compression happens inside it, and so does its error feedback (the
    residual it returns is ``acc - what the replicas agreed on``, as
    :mod:`tf_sparsify.compressors.error_memory`
    defines it). It cannot give each replica's contribution apart (``per_replica``)."""

    def start(
        self,
        tensor: tf.Tensor,
        before: UnitMemory,
        iteration: tf.Tensor | int,
        tensor_id: int,
        replicas: ReplicaGroup,
        per_replica: bool,
        sparse_update: bool,
    ) -> Started:
        """The protocol of :meth:`rounds`; nothing is sent before it starts."""
        if per_replica:
            raise ValueError(
                f"{self!r} cannot give each replica's contribution (`per_replica`, as "
                "delayed updates, IAG and simulated workers need): its replicas agree on one "
                "sum inside the exchange."
            )
        ctx = Context(tensor.shape, tensor.dtype, iteration, tensor_id)
        rounds = self.rounds(tensor, before.residual, before.compressor_state, ctx, replicas)
        return Started(rounds, ctx)

    @abc.abstractmethod
    def rounds(
        self,
        tensor: tf.Tensor,
        residual: tf.Tensor | None,
        state: tuple[tf.Tensor, ...],
        ctx: Context,
        replicas: ReplicaGroup,
    ) -> Rounds:
        """Compress ``tensor`` (plus ``residual`` with error feedback), yield transfers, and
        return the :class:`~tf_sparsify.compressors.rounds.Outcome` (update divided by the
        divisor, new residual, new state). ``state`` holds the tensors of :meth:`state_specs`."""


def serialize(compressor: Compressor) -> dict[str, Any]:
    """``{"class_name": ..., "config": ...}`` for Keras configs."""
    return COMPRESSORS.serialize(compressor)


def deserialize(config: dict[str, Any] | Compressor) -> Compressor:
    """Inverse of :func:`serialize`; a compressor instance passes through."""
    return COMPRESSORS.deserialize(config)


def check_ratio(ratio: Any) -> float:
    """A density in (0, 1], returned as the Python float of its decimal value (see
    :func:`decimal_ratio`): ``np.float32(0.1)`` becomes ``0.1``, not ``0.10000000149011612``."""
    if not is_number(ratio, numbers.Real) or not 0 < ratio <= 1:
        raise ValueError(f"`ratio` must be a number in (0, 1]; received ratio={ratio!r}")
    return float(decimal_ratio(ratio))


def decimal_ratio(ratio: Any) -> fractions.Fraction:
    """The value a user means by ``ratio``, exactly: the shortest decimal that reads back as
    the number in its own type (``repr`` of a Python float; NumPy's shortest digits for a
    float16 or float32 scalar), an integer as itself.

    ``0.07`` is the double ``0.07000000000000000666...`` and ``np.float32(0.1)`` is
    ``0.100000001490116...``; taken as they are, ``ceil(ratio * d)`` keeps 8 of 100 and 11 of
    100 entries. Their decimals, 7/100 and 1/10, keep 7 and 10.
    """
    if isinstance(ratio, numbers.Integral):
        return fractions.Fraction(int(ratio))
    if isinstance(ratio, np.floating) and ratio.dtype.itemsize < 8:
        text = np.format_float_positional(ratio, unique=True, trim="-")
    else:  # Python and NumPy doubles (wider NumPy floats are rounded to a double first)
        text = repr(float(ratio))
    return fractions.Fraction(text)


def check_contraction(compressor: Compressor, num_elements: int) -> float | None:
    """``compressor.contraction(num_elements)``; ValueError naming ``error_feedback`` if None,
    unless error feedback is part of the compressor's algorithm (``error_feedback_by_design``,
    PowerSGD: its residual is a projection of the accumulator, never longer than it)."""
    delta = compressor.contraction(num_elements)
    if delta is not None or compressor.error_feedback_by_design:
        return delta
    beta = compressor.variance_bound(num_elements) if compressor.unbiased else None
    why = (
        f"it is unbiased with variance bound beta = {beta:.4g} >= 1, so delta = 1 - beta <= 0; "
        "an unbiased compressor needs no error feedback: use error_feedback=False"
        if beta is not None
        else "it declares no contraction (contraction() is None)"
    )
    raise ValueError(
        "`error_feedback=True` needs a compressor that contracts, E||x - C(x)||^2 <= "
        "(1 - delta) ||x||^2 with delta > 0, or the residual grows without bound; "
        f"{compressor!r} does not on a tensor of {num_elements} entries: {why}."
    )


def k_for(num_elements: int | tf.Tensor, ratio: float | None, k: int | None) -> int | tf.Tensor:
    """Entries to keep: ``k`` clamped to the tensor size, else ``max(1, ceil(ratio * d))``
    (at most ``d``) computed exactly with the ratio's decimal value (:func:`decimal_ratio`):
    ``ratio=0.07`` keeps 7 of 100. The one rule for every compressor that takes a ratio; ``d``
    may be an int64 tensor (rows touched in a step), and then so is the result."""
    low, high = (tf.minimum, tf.maximum) if tf.is_tensor(num_elements) else (min, max)
    if k is not None:
        return low(
            tf.cast(k, num_elements.dtype) if tf.is_tensor(num_elements) else k, num_elements
        )
    exact = decimal_ratio(ratio)
    ceiling = (exact.numerator * num_elements + exact.denominator - 1) // exact.denominator
    return low(num_elements, high(ceiling, low(num_elements, 1)))


def rng_seed(
    seed: int, step: tf.Tensor | int, tensor_id: int, replica_id: tf.Tensor | int = 0
) -> tf.Tensor:
    """A shape-[2] int64 seed for ``tf.random.stateless_*`` from the four keys."""
    key = tf.constant([seed, tensor_id], tf.int64)
    for data in (step, replica_id):
        key = xla.fold_in(key, tf.cast(data, tf.int64))
    return key


def ones_at(indices: tf.Tensor, ctx: Context) -> tf.Tensor:
    """1 at the distinct flat ``indices``, 0 elsewhere, in ``ctx``'s shape and dtype."""
    flat = tf.reshape(indices, [-1])
    ones = tf.ones_like(flat, dtype=ctx.dtype)
    return tf.reshape(ops.scatter_sum(ones, flat, ctx.num_elements), ctx.shape)
