"""State kinds (tf_sparsify.core.state_kinds): aggregation, and the one conservation rule of a
restore into a job of another size, also as the checkpoint manifest applies it per process."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tf_sparsify.core.checkpoint_manifest import rows_of_process
from tf_sparsify.core.state_kinds import StateKind

ROWS = np.arange(12, dtype=np.float32).reshape(3, 4)  # 3 replicas' rows of a 4-vector


def test_kinds_carry_their_aggregation_and_manifest_names():
    assert StateKind.PER_REPLICA.aggregation == tf.VariableAggregation.SUM
    assert StateKind.PER_REPLICA_MEAN.aggregation == tf.VariableAggregation.MEAN
    assert StateKind.REPLICATED.aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA
    assert StateKind.SHARED.synchronization == tf.VariableSynchronization.AUTO
    assert [k.per_replica for k in StateKind] == [True, True, False, False]
    assert StateKind("per_replica") is StateKind.PER_REPLICA == "per_replica"


@pytest.mark.parametrize("count", [1, 2, 5])
def test_a_resize_conserves_a_sum_and_keeps_a_mean(count):
    summed = StateKind.PER_REPLICA.resized(ROWS, count)
    assert summed.shape == (count, 4) and summed.dtype == ROWS.dtype
    np.testing.assert_allclose(summed.sum(0), ROWS.sum(0), rtol=1e-6)
    np.testing.assert_allclose(summed, np.stack([ROWS.sum(0) / count] * count), rtol=1e-6)
    np.testing.assert_allclose(
        StateKind.PER_REPLICA_MEAN.resized(ROWS, count).mean(0), ROWS.mean(0)
    )


def test_each_process_of_a_larger_job_restores_its_share_of_the_total():
    saved = {"first_row": 0, "world": 3}
    shares = [
        rows_of_process(StateKind.PER_REPLICA, ROWS, local=2, first=first, world=4, manifest=saved)
        for first in (0, 2)
    ]
    total = sum(rows.sum(0) for rows, _ in shares)
    np.testing.assert_allclose(total, ROWS.sum(0), rtol=1e-6)
    assert all("conserved" in note for _, note in shares)
    same, note = rows_of_process(StateKind.PER_REPLICA, ROWS, 1, 2, 3, saved)
    np.testing.assert_array_equal(same, ROWS[2:3])
    assert note == ""
    missing, note = rows_of_process(StateKind.PER_REPLICA, ROWS[:1], 1, 2, 3, saved)
    assert missing is None and "starts from zero" in note
