"""The plan check: every rank must plan the same messages before any payload travels.

Ranks built with a different compressor, ``k``, option, model or dtype would otherwise hand
Horovod differently named or differently shaped payloads, which it may wait on forever (or,
for an all-gather of other sizes, accept silently). So before the first exchange each rank
gathers a fixed-length int64 fingerprint of its plan with one all-gather of a fixed name, and
every rank raises the same ``InvalidArgumentError`` naming the first field that differs.

With late buckets every step checks so (:func:`check_step`), and the fingerprint says whether
the step is a training step or ``apply_in_flight``: a rank that applies what is in flight while
another trains would otherwise wait forever on collectives its peer never starts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import tensorflow as tf

from tf_sparsify.compressors.base import serialize
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.plan import Unit
from tf_sparsify.core.step import GradientKind
from tf_sparsify.horovod._hvd import hvd

#: What the fingerprint covers, in the order mismatches are reported.
FIELDS = (
    "step",
    "ranks_per_node",
    "compressor",
    "pipeline options",
    "variable shapes and dtypes",
    "variables without a gradient",
    "variables with sparse gradients",
    "messages",
)


def plan_fields(
    pipeline: GradientPipeline,
    units: Sequence[Unit],
    ranks_per_node: int | None = None,
    present: Sequence[GradientKind] | None = None,
    flush: bool = False,
) -> list[tuple[str, str]]:
    """``(field, description)`` pairs of a plan, aligned with :data:`FIELDS`
    (``ranks_per_node``: the hierarchical exchange's, ``None`` for the flat one; ``present``:
    what each variable's gradient is in the step, ``None`` for all dense; ``flush``: the step
    applies what is in flight, ``apply_in_flight``).

    A variable's payload travels only from ranks that have its gradient, so ranks that differ
    in which gradients are ``None`` would wait for each other forever: they fail here. So do
    ranks where one variable's gradient is sparse on some and dense on others (their payloads
    travel by different collectives). How many rows a sparse gradient touches is not part of
    the plan: it differs by step and rank, and its all-gather takes any row count."""
    present = present or ()
    missing = [i for i, p in enumerate(present) if p is GradientKind.ABSENT]
    sparse = [i for i, p in enumerate(present) if p is GradientKind.ROWS]
    options = {k: v for k, v in pipeline.get_config().items() if k != "compressor"}
    variables = sorted(
        (i, s.as_list(), u.dtype.name)
        for u in units
        for i, s in zip(u.indices, u.shapes, strict=True)
    )
    messages = [
        (list(u.indices), serialize(u.compressor), u.error_feedback, u.wire_bytes) for u in units
    ]
    return list(
        zip(
            FIELDS,
            (
                "apply_in_flight (the update in flight)" if flush else "a training step",
                repr(ranks_per_node),
                repr(pipeline.compressor),
                repr(dict(sorted(options.items()))),
                ", ".join(f"{dtype}{shape}" for _, shape, dtype in variables),
                f"variables {missing}" if missing else "none",
                f"variables {sparse}" if sparse else "none",
                repr(messages),
            ),
            strict=True,
        )
    )


def stamp(fields: Sequence[tuple[str, str]]) -> tf.Tensor:
    """The plan's fingerprint: one int64 per field of :data:`FIELDS`."""
    return tf.constant([_hash(description) for _, description in fields], tf.int64)


def check_once(
    done: tf.Variable, sent: tf.Variable, fields: Sequence[tuple[str, str]]
) -> tf.Tensor:
    """Run the check (:func:`check_step`) unless ``done`` (a local, never checkpointed bool
    variable) is set.

    Returns a boolean tensor to make the exchange wait for. The check is one all-gather of a
    ``[1, len(FIELDS)]`` int64 tensor under a fixed name, the same on every rank whatever its
    configuration, so it cannot deadlock; every rank sees all fingerprints and fails alike.
    """

    def check() -> tf.Tensor:
        with tf.control_dependencies([check_step(sent, fields)]):
            return tf.identity(done.assign(True, read_value=True))

    return tf.cond(done, lambda: tf.constant(True), check)


def check_step(sent: tf.Variable, fields: Sequence[tuple[str, str]]) -> tf.Tensor:
    """The check itself, in this step whatever ran before: its all-gather has the same fixed
    name in every step, so it pairs with the check of whatever step another rank runs.

    The fingerprint travels through ``sent`` (a local int64 variable of ``len(FIELDS)``):
    Horovod's ops are not marked stateful, so Grappler would fold an all-gather of a constant
    while it optimizes the graph, and the step would never check at run time."""
    local = stamp(fields)
    gathered = _gather_plan(sent.assign(local, read_value=True))
    return assert_same(gathered, local, fields)


@tf.function
def _gather_plan(fingerprint: tf.Tensor) -> tf.Tensor:
    """Every rank's fingerprint, ``[ranks, len(FIELDS)]``: one all-gather named
    ``tf_sparsify_plan_check`` whether the step is traced or eager (eagerly, Horovod names an
    op by its type, so an eager check would not pair with a traced one)."""
    return hvd.allgather(fingerprint[None], name="tf_sparsify_plan_check", ignore_name_scope=True)


def assert_same(
    gathered: tf.Tensor, local: tf.Tensor, fields: Sequence[tuple[str, str]]
) -> tf.Tensor:
    """A boolean tensor whose op fails on every rank alike, naming the first field that
    differs, unless every row of ``gathered`` (``[ranks, len(FIELDS)]``, every rank's
    :func:`stamp`) equals this rank's ``local`` stamp.

    One ``Assert`` op, its message picked by the first differing column: no ``tf.cond`` per
    field (each costs two traced branch graphs, and this runs in every traced step)."""
    size, rank = hvd.size(), hvd.rank()
    gathered = tf.ensure_shape(gathered, [size, len(fields)])
    differs = tf.reduce_any(tf.not_equal(gathered, local[None]), axis=0)
    first = tf.argmax(tf.cast(differs, tf.int32), output_type=tf.int32)
    messages = tf.constant(
        [
            "tf_sparsify.horovod: the ranks are configured differently, they "
            f"differ in their {field}: rank {rank} of {size} has {_short(description)}. "
            "Every rank must build the same model and the same optimizer/exchange "
            "(ranks_per_node, compressor, k or ratio, error feedback, scope, sizes, "
            "dtypes) and call set_compressor and apply_in_flight alike."
            for field, description in fields
        ]
    )
    same = tf.logical_not(tf.reduce_any(differs))
    assertion = tf.raw_ops.Assert(
        condition=same,
        data=[
            tf.gather(messages, first),
            "Fingerprints of that field, rank by rank:",
            gathered[:, first],
            "and on this rank:",
            local[first],
        ],
        summarize=size,
    )
    with tf.control_dependencies([assertion]):
        return tf.identity(same)


def _hash(description: str) -> int:
    digest = hashlib.sha256(description.encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
