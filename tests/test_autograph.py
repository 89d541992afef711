"""AutoGraph leaves the package's functions as written inside a user's ``tf.function``."""

from __future__ import annotations

from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.autograph.core import config
from tensorflow.python.autograph.impl import api, conversion
from tensorflow.python.autograph.pyct import cache

import tf_sparsify as tfs
from tf_sparsify.common.autograph import PACKAGE, leave_unconverted


def converted_in_a_custom_loop_step() -> list[str]:
    """The package's functions AutoGraph sets out to convert while tracing one custom-loop
    step. Each then runs as written: converting them (and all they call) takes seconds and
    shows nothing more."""
    variables = [tf.Variable(np.ones((8, 4), np.float32)), tf.Variable(np.ones(4, np.float32))]
    optimizer = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.25))
    optimizer.build(variables)

    @tf.function
    def step():
        optimizer.apply([v * 0.5 for v in variables], variables)

    convert_for_real = api._convert_actual

    def convert(entity, program_ctx):
        if not getattr(entity, "__module__", "").startswith(PACKAGE + "."):
            return convert_for_real(entity, program_ctx)

        function = getattr(entity, "__func__", entity)  # called with self first, as converted

        def as_written(*args, **kwargs):
            return function(*args, **kwargs)

        as_written.ag_source_map = {}  # what AutoGraph reads of a converted function
        return as_written

    with mock.patch.object(api, "_convert_actual", side_effect=convert) as asked:
        step()
    names = [f"{c.args[0].__module__}.{c.args[0].__qualname__}" for c in asked.call_args_list]
    return [name for name in names if name.startswith(PACKAGE + ".")]


def test_a_custom_loop_step_converts_none_of_the_package():
    assert leave_unconverted()
    assert converted_in_a_custom_loop_step() == []


def test_without_the_rule_autograph_would_convert_the_package(monkeypatch):
    ours = [r for r in config.CONVERSION_RULES if str(r).endswith(f" {PACKAGE}")]
    assert len(ours) == 1, "the rule is added once, however often it is asked for"
    monkeypatch.setattr(
        config, "CONVERSION_RULES", tuple(r for r in config.CONVERSION_RULES if r not in ours)
    )
    # AutoGraph remembers what it left unconverted: forget it for this test
    monkeypatch.setattr(conversion, "_ALLOWLIST_CACHE", cache.UnboundInstanceCache())
    assert converted_in_a_custom_loop_step()
