"""Auto's choice per unit (``tf_sparsify.step_model.choice``): the least compression whose
exchange hides under the compute that can overlap it, by the step model; Accordion's guard."""

from __future__ import annotations

import math

import pytest

from tf_sparsify.step_model.buckets import fill_buckets
from tf_sparsify.step_model.choice import (
    Setting,
    choose,
    compute_for,
    critical,
    predicted_step,
)
from tf_sparsify.step_model.methods import DenseAllReduce, TopKAllGather
from tf_sparsify.step_model.network import Cluster, Link
from tf_sparsify.step_model.predict import comm_time
from tf_sparsify.step_model.shapes import Layers

N = 1_000_000
#: two equal vectors: the first layer's ready when the step's compute ends, the other at 2/3
UNITS = Layers(((N,), (N,)))
#: each with its own cost: 3 ms (FP16) and 10 ms (TopK) per unit of a million entries
SETTINGS = (
    Setting("dense", DenseAllReduce(4)),
    Setting("fp16", DenseAllReduce(2, name="fp16"), seconds_per_element=3e-9),
    Setting("topk1%", TopKAllGather(0.01), seconds_per_element=1e-8),
)
COMPUTE = 1.0


def cluster(dense_seconds: float) -> Cluster:
    """Two workers on a link where one unit's dense fp32 all-reduce (``4 N`` bytes sent, ring,
    P = 2) takes ``dense_seconds``."""
    return Cluster(nodes=2, inter=Link(bandwidth=4 * N / dense_seconds))


def test_a_fast_link_keeps_every_unit_dense():
    """The first layer's exchange (5 ms) starts when the compute ends, so it never hides; but
    FP16 would save 2.5 ms for 3 ms of casts, TopK under 5 ms for 10 ms."""
    choice = choose(UNITS, SETTINGS, cluster(0.005), COMPUTE)
    assert choice.levels == (0, 0) and not choice.hidden
    assert choice.step == pytest.approx(COMPUTE + 0.005)


def test_the_exposed_first_layer_is_compressed_the_other_stays_dense():
    """Dense: the second unit's exchange runs from 2/3 to 0.867 under compute, the first's from
    1.0 to 1.2, exposed. FP16 halves the first one's (1.1, plus 3 ms); TopK 1% sends 10,000
    values and their index code (about 51 kB, 1/40 of FP16's): 1.003 plus 10 ms. No raise of
    the second unit shortens the step."""
    choice = choose(UNITS, SETTINGS, cluster(0.2), COMPUTE)
    assert choice.levels == (2, 0)
    topk = predicted_step((2, 0), UNITS, SETTINGS, cluster(0.2), COMPUTE)
    assert choice == topk and 1.01 < topk.step < 1.015 and not topk.hidden
    assert predicted_step((0, 0), UNITS, SETTINGS, cluster(0.2), COMPUTE).step == pytest.approx(1.2)
    assert predicted_step((1, 0), UNITS, SETTINGS, cluster(0.2), COMPUTE).step == pytest.approx(
        1.103
    )


def test_the_least_compression_that_hides_is_taken():
    """With the first layer a step late its exchange runs from 0: at 0.2 s per dense exchange
    both hide (the second from 2/3 to 0.867), so nothing is compressed. At 0.5 s the second
    one's ends at 1.167; compressing the first does not move it, FP16 on the second (0.25 s)
    hides it, and its casts are the only cost left."""
    assert choose(UNITS, SETTINGS, cluster(0.2), COMPUTE, late_buckets="last").levels == (0, 0)
    choice = choose(UNITS, SETTINGS, cluster(0.5), COMPUTE, late_buckets="last")
    assert choice.hidden and choice.levels == (0, 1)
    assert choice.step == pytest.approx(COMPUTE + 0.003)


def test_host_work_does_not_hide_so_it_is_compressed_away():
    """The same exchanges, each also 0.2 s of work on the cores the compute needs (a CPU-only
    job on a loopback link): under compute they hid, nothing was compressed; as host work they
    add to the compute (1.4 s dense), and TopK 1% on both units leaves 1/40 of it plus its own
    cost. The compute calibrated from that step is the compute again."""
    late = {"late_buckets": "last"}
    assert choose(UNITS, SETTINGS, cluster(0.2), COMPUTE, **late).levels == (0, 0)
    host = {**late, "host": cluster(0.2)}
    dense = predicted_step((0, 0), UNITS, SETTINGS, cluster(0.2), COMPUTE, **host)
    assert dense.step == pytest.approx(1.4) and dense.host == pytest.approx(0.4)
    choice = choose(UNITS, SETTINGS, cluster(0.2), COMPUTE, **host)
    assert choice.levels == (2, 2) and 0 < choice.host < 0.4 / 30
    assert choice.step == pytest.approx(COMPUTE + choice.host + choice.overhead)
    measured = choice.step
    assert compute_for(measured, (2, 2), UNITS, SETTINGS, cluster(0.2), **host) == pytest.approx(
        COMPUTE, rel=1e-5
    )


def test_more_compression_for_a_step_within_the_tolerance_is_not_taken():
    """TopK 0.1% on the exposed first layer sends a tenth of TopK 1%'s bytes at the same cost:
    its step is under half a per cent shorter, within the 2 % the least compression may add,
    so TopK 1% stays; without a tolerance the shortest step is taken."""
    settings = (*SETTINGS, Setting("topk0.1%", TopKAllGather(0.001), seconds_per_element=1e-8))
    steps = [predicted_step((lv, 0), UNITS, settings, cluster(0.2), COMPUTE).step for lv in (2, 3)]
    assert 0.995 * steps[0] < steps[1] < steps[0]
    assert choose(UNITS, settings, cluster(0.2), COMPUTE).levels == (2, 0)
    assert choose(UNITS, settings, cluster(0.2), COMPUTE, tolerance=0).levels == (3, 0)


def test_compression_that_costs_more_than_it_saves_is_not_taken():
    slow_topk = Setting("topk1%", TopKAllGather(0.01), seconds_per_element=1e-6)
    choice = choose(UNITS, (SETTINGS[0], slow_topk), cluster(0.2), COMPUTE)
    assert choice.levels == (0, 0) and choice.step == pytest.approx(1.2)


def test_pinned_units_keep_their_setting_and_critical_ones_stay_mild():
    assert choose(UNITS, SETTINGS, cluster(0.2), COMPUTE, pinned={0: 0}).levels == (0, 0)
    assert choose(UNITS, SETTINGS, cluster(0.005), COMPUTE, pinned={1: 2}).levels == (0, 2)
    guarded = choose(UNITS, SETTINGS, cluster(0.2), COMPUTE, critical=[True, False])
    assert guarded.levels == (1, 0) and guarded.step == pytest.approx(1.103)


def test_a_buckets_units_with_one_setting_are_one_collective():
    """With no compute the step is the exchange: in one bucket, each setting's units cost the
    collective of those units together (one call); a unit each costs a call each. Buckets
    fill in backprop order and close at ``bucket_bytes``, as the plan's."""
    shapes = Layers(((300, 40), (40,), (40, 10), (10,)))
    link = Cluster(nodes=2, inter=Link(bandwidth=1e8, call_overhead=3e-3))
    levels = [2, 0, 2, 0]
    fused = predicted_step(levels, shapes, SETTINGS, link, 0.0, bucket_bytes=2**20)
    dense, topk = (Layers(tuple(shapes.shapes[i] for i in ix)) for ix in ((1, 3), (0, 2)))
    want = comm_time(SETTINGS[0].method, dense, link) + comm_time(SETTINGS[2].method, topk, link)
    assert fused.step - fused.overhead == pytest.approx(want, rel=1e-12)
    alone = predicted_step(levels, shapes, SETTINGS, link, 0.0)
    assert alone.step - fused.step == pytest.approx(2 * 3e-3, rel=1e-9)  # 4 calls, not 2
    assert fill_buckets([10, 10, 10, 10, 10], 15) == [0, 0, 1, 1, 2]


def test_a_buckets_small_units_are_raised_together_where_one_alone_would_not_pay():
    """Twenty small units in one bucket on a slow link with a 5 ms call: raising one alone
    adds a collective (its call costs more than its bytes save), so one-unit raises stall at
    dense; raising the bucket's dense units together pays, and then again to TopK."""
    units = Layers(((10_000,),) * 20)
    link = Cluster(nodes=2, inter=Link(bandwidth=1e7, call_overhead=5e-3))
    model = dict(cluster=link, compute=0.01, bucket_bytes=2**20)
    dense = predicted_step([0] * 20, units, SETTINGS, **model)
    one = predicted_step([1] + [0] * 19, units, SETTINGS, **model)
    assert one.step > dense.step
    choice = choose(units, SETTINGS, **model)
    assert choice.levels == (2,) * 20 and choice.step < dense.step / 5


def test_accordions_rule():
    assert critical([1.0, 2.0], None) == [True, True]
    assert critical([1.0, 2.0, 0.4], [1.0, 1.0, 1.0]) == [False, True, True]
    assert critical([1.49, 1.5], [1.0, 1.0]) == [False, True]
    assert critical([1.2], [1.0], eta=0.1) == [True]


def test_an_infinite_link_and_no_compute_still_choose():
    free = Cluster(nodes=2, inter=Link(bandwidth=math.inf))
    assert choose(UNITS, SETTINGS, free, 0.0).levels == (0, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compute": -1.0}, "compute"),
        ({"critical_level": 3}, "critical_level"),
        ({"pinned": {2: 0}}, "pinned unit"),
        ({"pinned": {0: 5}}, r"pinned\[0\]"),
        ({"critical": [True]}, "critical"),
        ({"late_buckets": "first"}, "late_buckets"),
        ({"backward_fraction": 0.0}, "backward_fraction"),
        ({"tolerance": -0.01}, "tolerance"),
    ],
)
def test_bad_input_is_named(kwargs, message):
    args = {"compute": COMPUTE, **kwargs}
    compute = args.pop("compute")
    with pytest.raises(ValueError, match=message):
        choose(UNITS, SETTINGS, cluster(0.2), compute, **args)


def test_bad_settings_and_norms_are_named():
    with pytest.raises(ValueError, match="settings"):
        choose(UNITS, (), cluster(0.2), COMPUTE)
    with pytest.raises(ValueError, match="seconds_per_element"):
        Setting("topk", TopKAllGather(0.01), seconds_per_element=-1.0)
    with pytest.raises(ValueError, match="previous"):
        critical([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="eta"):
        critical([1.0], [1.0], eta=0.0)
