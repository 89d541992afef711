"""The network what-if model (``tf_sparsify.analysis.whatif``): formulas against hand-computed
values, monotonicity in bandwidth and P, the TopK/dense crossover against its closed form, and
bad input. The command line is in test_whatif_cli.py, the validation script in
test_whatif_validate.py."""

from __future__ import annotations

import math

import pytest

import tf_sparsify as tfs
from tf_sparsify.analysis import theory
from tf_sparsify.analysis import whatif as w

GBIT = 1e9 / 8
FLAT = w.Layers(((10**6,),))  # k = 1% of 10^6 exactly; no rounding per tensor
TOPK = w.TopKAllGather(0.01, index_bytes=4)  # int32 indices: 8 bytes per entry, hand-computable
METHODS = [
    w.DenseAllReduce(4, "dense"),
    w.DenseAllReduce(2, "fp16"),
    TOPK,
    w.TopKSplitReduce(0.01),
    w.QSGDAllGather(4),
    w.PowerSGDAllReduce(4),
]


def cluster(p: int, bandwidth: float = 10 * GBIT, latency: float = 0.0, **link) -> w.Cluster:
    return w.Cluster(p, w.Link(bandwidth, latency, **link))


# -- formulas ----------------------------------------------------------------------------------
def test_collectives_rounds_and_bytes():
    assert w.all_reduce(100, 4, "ring") == w.Transfer("inter", 4, 6, 150)
    assert w.all_reduce(100, 4, "logarithmic") == w.Transfer("inter", 4, 4, 150)
    assert w.all_gather(10, 4, "ring") == w.Transfer("inter", 4, 3, 30)
    assert w.all_gather(10, 5, "logarithmic").rounds == 3
    assert w.all_to_all(8, 4) == w.Transfer("inter", 4, 3, 6)
    assert w.all_to_all(8, 4, per_node=2).bytes_sent == 8  # 2 ranks x 2 of 4 slices off-node
    assert w.all_reduce(100, 1, "ring") == w.Transfer("inter", 1, 0, 0)


def test_link_time_hand_computed():
    reduce = w.all_reduce(100, 4, "ring")  # 6 rounds, 150 bytes
    link = w.Link(100, latency=0.5, call_overhead=1)
    assert w.link_time([reduce], link) == pytest.approx(1 + 6 * 0.5 + 1.5)
    # shared medium: all 4 workers' 30 bytes queue behind one limit, less a 100-byte burst
    shared = w.Link(100, shared=True, burst_bytes=100)
    assert w.link_time([w.all_gather(10, 4, "ring")], shared) == pytest.approx(0.2)
    # the host pushes 10 bytes/s: slower than the link, so it sets the time
    host = w.Link(1e9, host_bandwidth=10)
    assert w.link_time([w.all_gather(10, 2, "ring")], host) == pytest.approx(1.0)
    assert w.link_time([], link) == 0


def test_link_burst_needs_a_shared_medium():
    with pytest.raises(ValueError, match=r"burst_bytes.*shared"):
        w.Link(GBIT, burst_bytes=1)
    unshared = w.Link(GBIT)
    reduce = w.all_reduce(8e6, 8, "ring")
    assert w.link_time([reduce], unshared) == pytest.approx(2 * 7 / 8 * 8e6 / GBIT)
    shared = w.Link(GBIT, shared=True, burst_bytes=1e6)
    assert w.link_time([reduce], shared) == pytest.approx((8 * 2 * 7 / 8 * 8e6 - 1e6) / GBIT)


def test_payload_bytes_of_the_benchmark_mlp():
    """The benchmark measured 40,083,496 bytes/step (dense) and 508,118 (TopK 1%) per rank."""
    assert w.MLP10M.num_params == 10_020_874
    assert w.DenseAllReduce().payload_bytes(w.MLP10M) == 40_083_496
    # k per tensor: 16057 + 2 x 41944 + 205 (kernels), 3 x 21 + 1 (biases)
    assert w.TopKAllGather(0.01).entries(w.MLP10M) == 100_214
    assert w.TopKAllGather(0.01).payload_bytes(w.MLP10M) == 508_118
    assert w.TopKAllGather(0.01, index_bytes=4).payload_bytes(w.MLP10M) == 801_712
    assert w.TopKAllGather(0.01, value_bytes=2, index_bytes=2).payload_bytes(w.MLP10M) == 400_856
    assert w.QSGDAllGather(4).payload_bytes(w.MLP10M) == 10_020_874 + 4 * 8
    assert w.QSGDAllGather(200, bucket_size=1000).payload_bytes(FLAT) == 2 * 10**6 + 4 * 1000


@pytest.mark.parametrize("ratio", [0.01, 0.001, 0.3, 1.0])
@pytest.mark.parametrize(("value_dtype", "value_bytes"), [(None, 4), ("bfloat16", 2)])
def test_topk_bytes_are_the_compressors_wire_bytes(ratio, value_dtype, value_bytes):
    """The model's TopK payload is what tfs.TopK puts on the wire (values and packed indices)."""
    layers = w.Layers(((784, 2048), (2048,), (3, 5), (1,), (2**31 + 5,)))
    compressor = tfs.TopK(ratio=ratio, value_dtype=value_dtype)
    wire = sum(compressor.wire_bytes(d) for d in layers.sizes)
    assert w.TopKAllGather(ratio, value_bytes).payload_bytes(layers) == wire


def test_powersgd_factors_hand_computed():
    """Every MLP10M kernel pays at rank 4: P holds 4 x (784 + 3 x 2048) rows and the biases,
    Q holds 4 x (3 x 2048 + 10)."""
    first, second = w.PowerSGDAllReduce(4).factor_entries(w.MLP10M)
    assert (first, second) == (4 * 6928 + 6154, 4 * 6154)
    transfers = w.PowerSGDAllReduce(4).transfers(w.MLP10M, cluster(8))
    assert [t.bytes_sent for t in transfers] == [2 * 7 / 8 * 4 * first, 2 * 7 / 8 * 4 * second]
    # a 3 x 3 matrix does not pay at rank 2 (2 x 6 >= 9): sent dense with P; a vector too
    assert w.PowerSGDAllReduce(2).factor_entries(w.Layers(((3, 3), (5,)))) == (14, 0)
    assert w.PowerSGDAllReduce(1).factor_entries(w.Layers(((2, 3, 4),))) == (6, 4)


def test_sparse_all_reduce_and_hierarchical_hand_computed():
    topk = TOPK
    sar = w.TopKSplitReduce(0.01).transfers(FLAT, cluster(4))
    assert [(t.rounds, t.bytes_sent) for t in sar] == [(3, 60_000), (3, 60_000)]
    intra = w.Link(100 * GBIT, 1e-6)
    nodes = w.Cluster(4, w.Link(GBIT), gpus_per_node=8, intra=intra)
    hier = w.Hierarchical(topk).transfers(FLAT, nodes)
    assert hier == [w.all_reduce(4e6, 8, "ring", "intra"), w.all_gather(80_000, 4, "ring")]
    assert w.Hierarchical(topk).name == "hier-topk"
    expected = w.link_time(hier[:1], intra) + w.link_time(hier[1:], nodes.inter)
    assert w.comm_time(w.Hierarchical(topk), FLAT, nodes) == pytest.approx(expected)
    flat = w.comm_time(topk, FLAT, nodes)  # 32 workers in one all-gather: 31 payloads
    assert flat == pytest.approx(31 * 80_000 / GBIT)
    # one node: flat methods stay on the intra-node link, hierarchical has nothing to cross
    node = w.Cluster(1, w.Link(GBIT), gpus_per_node=8, intra=intra)
    for method in METHODS:
        assert {t.level for t in method.transfers(FLAT, node)} == {"intra"}
    assert w.comm_time(w.DenseAllReduce(), FLAT, node) == pytest.approx(
        w.link_time([w.all_reduce(4e6, 8, "ring")], intra)
    )
    assert w.Hierarchical(topk).transfers(FLAT, node) == hier[:1]


def test_step_time_and_predict():
    assert w.step_time(0.1, 0.02, 0.3, "none") == pytest.approx(0.42)
    assert w.step_time(0.1, 0.02, 0.3, "full") == pytest.approx(0.32)
    assert w.step_time(0.5, 0.02, 0.3, "full") == pytest.approx(0.52)
    out = w.predict(METHODS[:3], FLAT, cluster(2, GBIT), 0.1, {"topk": 0.01})
    dense, fp16, topk = out
    assert dense.comm == pytest.approx(4e6 / GBIT) and dense.bytes_sent == 4e6
    assert fp16.step == pytest.approx(0.1 + 2e6 / GBIT)
    assert topk.step == pytest.approx(0.1 + 0.01 + 80_000 / GBIT)
    assert w.winner(out) is topk
    assert theory.predict is w.predict and theory.crossover_workers is w.crossover_workers


# -- the step's timeline ----------------------------------------------------------------------
TIMELINE = {"comm": [0.2, 0.4], "sizes": [1, 3], "backward_fraction": 0.5}  # compute 1 s


@pytest.mark.parametrize(
    "overlap, late, expected",
    [
        # forward 0.5 s; unit 1 ready at 1 - 0.5 * 1/4 = 0.875, unit 0 at 1
        ("none", "none", 0.1 + 1 + 0.6),
        ("full", "none", 0.1 + 1),
        ("backprop", "none", 0.1 + 1 + 0.4 + 0.075),  # unit 1 0.875-1.275, unit 0 1.275-1.675
        ("backprop", "last", 0.1 + 0.875 + 0.4),  # unit 0 0-0.2, unit 1 0.875-1.275
        ("none", "last", 0.1 + 1 + 0.4),  # unit 0 0-0.2, unit 1 1-1.4
        ("full", "last", 0.1 + 1),
        ("backprop", "all", 0.1 + 1),
    ],
)
def test_timeline_hand_computed(overlap, late, expected):
    assert w.step_time(1.0, 0.1, overlap=overlap, late_buckets=late, **TIMELINE) == pytest.approx(
        expected, rel=1e-12
    )


@pytest.mark.parametrize("overlap", w.OVERLAPS)
@pytest.mark.parametrize("compute", [0.0, 0.3, 1.0, 5.0])
def test_timeline_identities(overlap, compute):
    """Nothing late: ``none`` adds the exchange after compute, ``full`` hides it up to compute;
    every unit late hides it up to compute whatever the overlap; late never makes it slower."""
    comms, sizes, overhead = [0.3, 0.05, 0.7, 0.15], [2, 7, 1, 5], 0.02
    total = sum(comms)

    def step(late: str, over: str = overlap) -> float:
        return w.step_time(compute, overhead, comms, over, late, sizes)

    assert step("none", "none") == pytest.approx(overhead + compute + total, rel=1e-12)
    assert step("none", "full") == pytest.approx(overhead + max(compute, total), rel=1e-12)
    assert step("all") == pytest.approx(overhead + max(compute, total), rel=1e-12)
    assert step("all") <= step("last") <= step("none")
    assert step("none", "full") <= step("none", "backprop") <= step("none", "none")


def test_predict_late_buckets_hand_computed():
    """Two tensors, 1000 and 3000 entries, fp32 over a 10 kB/s link at P = 2: dense sends 4n
    bytes, 0.4 s then 1.2 s. Compute 1.2 s: forward 0.4 s, backward 0.8 s; the second tensor
    is ready at 1.2 - 0.8 / 4 = 1.0 s, the first at 1.2 s."""
    layers, link = w.Layers(((1000,), (3000,))), cluster(2, bandwidth=1e4)
    assert w.unit_comms(w.DenseAllReduce(), layers, link) == pytest.approx([0.4, 1.2])

    def step(overlap: str, late: str) -> float:
        (dense,) = w.predict(
            [w.DenseAllReduce()], layers, link, 1.2, {"dense": 0.1}, overlap, late_buckets=late
        )
        assert dense.comm == pytest.approx(1.6)
        return dense.step - 0.1

    assert step("none", "none") == pytest.approx(2.8)
    assert step("full", "none") == step("full", "last") == pytest.approx(1.6)
    assert step("backprop", "none") == pytest.approx(2.6)  # 1.0-2.2, then 2.2-2.6
    assert step("backprop", "last") == pytest.approx(2.2)  # first 0-0.4, second 1.0-2.2
    assert step("none", "last") == pytest.approx(2.4)  # first 0-0.4, second 1.2-2.4
    for overlap in w.OVERLAPS:
        assert step(overlap, "all") == pytest.approx(1.6)
    (early,) = w.predict(
        [w.DenseAllReduce()], layers, link, 1.2, overlap="backprop", backward_fraction=1.0
    )
    assert early.step == pytest.approx(2.5)  # second ready at 1.2 - 1.2 / 4: 0.9-2.1, 2.1-2.5


def test_unit_comms_add_up_to_the_model():
    """With latency each tensor alone pays its rounds: the split keeps the model's total."""
    link = cluster(8, GBIT, latency=25e-6)
    for method in [*METHODS, w.Hierarchical(TOPK)]:
        units = w.unit_comms(method, w.MLP10M, link)
        assert len(units) == len(w.MLP10M.shapes) and min(units) >= 0
        assert sum(units) == pytest.approx(w.comm_time(method, w.MLP10M, link), rel=1e-12)
    assert w.unit_comms(TOPK, w.MLP10M, cluster(1)) == [0.0] * len(w.MLP10M.shapes)


@pytest.mark.parametrize("overlap", w.OVERLAPS)
def test_old_modes_and_all_late_keep_the_whole_model_numbers(overlap):
    link = cluster(16, GBIT, latency=25e-6)
    for method in METHODS:
        comm = w.comm_time(method, w.MLP10M, link)
        (none,) = w.predict([method], w.MLP10M, link, 0.05, overlap=overlap)
        (late,) = w.predict([method], w.MLP10M, link, 0.05, overlap=overlap, late_buckets="all")
        assert late.step == pytest.approx(max(0.05, comm), rel=1e-12)
        if overlap != "backprop":
            assert none.step == w.step_time(0.05, 0.0, comm, overlap)  # exactly


def test_sweep_passes_the_timeline_on():
    timeline = {"overlap": "backprop", "backward_fraction": 0.5}
    for late in w.LATE_BUCKETS:
        results = w.sweep(
            METHODS[:3], w.MLP10M, cluster(1), 0.05, [GBIT], [2, 8], late_buckets=late, **timeline
        )
        for p in (2, 8):
            expected = w.predict(
                METHODS[:3], w.MLP10M, cluster(p, GBIT), 0.05, late_buckets=late, **timeline
            )
            assert results[GBIT][p] == expected
    assert theory.LATE_BUCKETS == w.LATE_BUCKETS == ("none", "last", "all")
    assert theory.unit_comms is w.unit_comms and "backprop" in theory.OVERLAPS


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"late_buckets": "some"}, "`late_buckets` must be one of .*; got 'some'"),
        ({"backward_fraction": 0}, "`backward_fraction` .*backward_fraction=0"),
        ({"backward_fraction": 1.5}, "`backward_fraction` .*backward_fraction=1.5"),
        ({"backward_fraction": math.nan}, "`backward_fraction` .*backward_fraction=nan"),
        ({"overlap": "partial"}, "`overlap` must be one of .*; got 'partial'"),
    ],
)
def test_bad_timeline_names_the_argument_and_value(kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        w.predict(METHODS, FLAT, cluster(2), 0.1, **kwargs)
    with pytest.raises(ValueError, match=expected):
        w.step_time(0.1, 0.0, [0.1, 0.2], **kwargs)


def test_step_time_sizes_must_match_the_units():
    with pytest.raises(ValueError, match="sizes"):
        w.step_time(0.1, 0.0, [0.1, 0.2], sizes=[1])


def test_layers_from_params():
    assert w.Layers.from_params(100).shapes == ((10, 10),)
    assert w.Layers.from_params(10).shapes == ((3, 3), (1,))
    assert w.Layers.from_params(25_000_001).num_params == 25_000_001


# -- monotonicity --------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS + [w.Hierarchical(w.TopKAllGather(0.01))])
def test_more_bandwidth_is_never_slower(method):
    intra = w.Link(200 * GBIT, 5e-6)
    for p in (1, 2, 3, 16, 128):
        steps = [
            w.predict([method], w.MLP10M, w.Cluster(p, w.Link(b, 25e-6), 4, intra), 0.1)[0].step
            for b in (0.1 * GBIT, GBIT, 10 * GBIT, 100 * GBIT, 1000 * GBIT)
        ]
        assert steps == sorted(steps, reverse=True)


def test_bytes_per_worker_in_p():
    workers = (2, 4, 16, 64, 256, 1024)

    def sent(method: w.Method) -> list[float]:
        return [w.bytes_sent(method, FLAT, cluster(p)) for p in workers]

    gather = sent(TOPK)
    assert gather == [(p - 1) * 80_000 for p in workers]  # grows linearly
    for method, payload in ((w.DenseAllReduce(), 4e6), (w.TopKSplitReduce(0.01), 80_000)):
        flat = sent(method)
        assert flat == sorted(flat) and flat[0] == payload and flat[-1] < 2 * payload
    factors = sent(w.PowerSGDAllReduce(4))
    assert max(factors) < 2 * w.PowerSGDAllReduce(4).payload_bytes(FLAT)


# -- crossover -------------------------------------------------------------------------------------
def test_crossover_closed_form():
    assert w.crossover_workers(0.01) == pytest.approx(100)  # fp32 values, int32 indices
    assert w.crossover_workers(0.01, dense_bytes=2) == pytest.approx(50)  # against bf16
    assert w.crossover_workers(0.001, 2, 2) == pytest.approx(2000)


@pytest.mark.parametrize("dense_bytes, expected", [(4, 100), (2, 50)])
def test_crossover_in_the_model_matches_the_closed_form(dense_bytes, expected):
    """With no latency, TopK 1% all-gather beats the ring all-reduce below P*, loses above."""
    methods = [w.DenseAllReduce(dense_bytes), TOPK]
    for p in (2, expected - 1, expected, expected + 1, 1000):
        dense, topk = (x.comm for x in w.predict(methods, FLAT, cluster(p), 0.0))
        if p < expected:
            assert topk < dense
        elif p == expected:
            assert topk == pytest.approx(dense)
        else:
            assert topk > dense


def test_sweep_and_winner_ranges():
    results = w.sweep(METHODS[:3], FLAT, cluster(1), 0.1, [GBIT, 10 * GBIT], range(2, 201))
    assert set(results) == {GBIT, 10 * GBIT} and list(results[GBIT]) == list(range(2, 201))
    ranges = w.winner_ranges(results[GBIT])
    # 16-bit dense ties TopK 1% at P = 50 and wins from there (the first of equals wins)
    assert ranges == [(2, 49, "topk"), (50, 200, "fp16")]
    with pytest.raises(ValueError, match="gpus_per_node"):
        grid = w.Cluster(1, w.Link(GBIT), 4, w.Link(GBIT))
        w.sweep(METHODS[:1], FLAT, grid, 0.1, [GBIT], [6])


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: w.Link(0), "bandwidth"),
        (lambda: w.Link(math.nan), "bandwidth"),
        (lambda: w.Link(GBIT, latency=-1), "latency"),
        (lambda: w.Link(GBIT, host_bandwidth=0), "host_bandwidth"),
        (lambda: w.Link(GBIT, burst_bytes=-1), "burst_bytes"),
        (lambda: w.Link(GBIT, call_overhead=True), "call_overhead"),
        (lambda: w.Cluster(0, w.Link(GBIT)), "nodes"),
        (lambda: w.Cluster(2, w.Link(GBIT), gpus_per_node=0), "gpus_per_node"),
        (lambda: w.Cluster(2, w.Link(GBIT), gpus_per_node=2), "intra"),
        (lambda: w.Cluster(2, w.Link(GBIT), schedule="tree"), "schedule"),
        (lambda: w.TopKAllGather(0), "ratio"),
        (lambda: w.TopKSplitReduce(1.5), "ratio"),
        (lambda: w.TopKAllGather(0.01, index_bytes=0), "index_bytes"),
        (lambda: w.DenseAllReduce(-2), "value_bytes"),
        (lambda: w.QSGDAllGather(0), "levels"),
        (lambda: w.QSGDAllGather(40_000), "levels"),
        (lambda: w.QSGDAllGather(4, bucket_size=0), "bucket_size"),
        (lambda: w.PowerSGDAllReduce(0), "rank"),
        (lambda: w.Layers(()), "shapes"),
        (lambda: w.Layers(((3, 0),)), "shapes"),
        (lambda: w.Layers.from_params(0), "num_params"),
        (lambda: w.predict(METHODS, FLAT, cluster(2), -1.0), "compute"),
        (lambda: w.predict(METHODS, FLAT, cluster(2), 0.1, overlap="some"), "overlap"),
        (lambda: w.predict(METHODS, FLAT, cluster(2), 0.1, {"topk": -1}), "overheads"),
        (lambda: w.predict(METHODS, FLAT, cluster(2), 0.1, {"nope": 1}), "overheads"),
        (lambda: w.crossover_workers(0), "ratio"),
        (lambda: w.crossover_workers(0.01, dense_bytes=0), "dense_bytes"),
    ],
)
def test_bad_input_names_the_argument(make, name):
    with pytest.raises(ValueError, match=name):
        make()
