"""The network what-if (``tf_sparsify.analysis.whatif``, its CLI and the validation script):
formulas
against hand-computed values, monotonicity in bandwidth and P, the TopK/dense crossover against
its closed form, the validation's calibration on synthetic rows, and bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

import tf_sparsify as tfs
from benchmarks import whatif_validate as wv
from tests.conftest import ROOT
from tf_sparsify.analysis import theory
from tf_sparsify.analysis import whatif as w
from tf_sparsify.analysis import whatif_cli as cli

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


# -- CLI -------------------------------------------------------------------------------------------
def test_cli_prints_each_method_and_the_winner(capsys):
    argv = ["--compute-ms", "100", "--params", "10M", "--workers", "8", "--bandwidth", "10gbit"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for name in ("dense", "fp16", "topk", "topk-sar", "qsgd", "powersgd"):
        assert f"\n{name} " in out
    assert "winner: " in out and "P = 8," in out


def test_cli_nodes_layers_json_and_overheads(tmp_path, capsys):
    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps([[784, 2048], [2048], 4096]))
    argv = ["--compute-ms", "50", "--layers", str(layers), "--nodes", "4", "--gpus-per-node"]
    argv += ["8", "--bandwidth", "1gbit", "--latency", "10us", "--overhead-ms", "topk=5"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "P = 32 (4 x 8)" in out and "\nhier-topk " in out and "1,611,776 parameters" in out


def test_cli_keras_model_shapes():
    layers = cli.keras_layers("mobilenetv2")
    assert len(layers.shapes) == 158 and layers.num_params == 3_504_872


def test_cli_units():
    assert cli.parse_bandwidth("10gbit") == pytest.approx(1.25e9)
    assert cli.parse_bandwidth("100mbit") == pytest.approx(12.5e6)
    assert cli.parse_duration("25us") == pytest.approx(25e-6)
    assert cli.parse_size("512kb") == 512 * 1024
    assert cli.parse_count("1.5G") == 1_500_000_000
    assert cli.parse_overheads("topk=8,qsgd=20") == {"topk": 0.008, "qsgd": 0.02}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--params", "1M", "--workers", "4", "--bandwidth", "10gbps"], "bandwidth"),
        (["--params", "1M", "--workers", "4", "--latency", "5"], "latency"),
        (["--params", "1M", "--workers", "0"], "nodes"),
        (["--params", "1M"], "--workers"),
        (["--params", "1M", "--workers", "4", "--methods", "dense,zip"], "methods"),
        (["--params", "1M", "--workers", "4", "--ratio", "2"], "ratio"),
        (["--params", "1M", "--workers", "4", "--nodes", "2"], "not both"),
    ],
)
def test_cli_bad_input(argv, message, capsys):
    try:
        code = cli.main(["--compute-ms", "10", *argv])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_module_entry_point_sweep_writes_a_png(tmp_path):
    png = tmp_path / "sweep.png"
    command = [sys.executable, "-m", "tf_sparsify", "whatif", "--compute-ms", "100"]
    command += ["--model", "mlp10m", "--sweep", "--plot", str(png)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rate in ("1gbit: P 2-", "10gbit: P 2-", "100gbit: P 2-"):
        assert rate in proc.stdout
    assert "  1024 " in proc.stdout and f"wrote {png}" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    usage = subprocess.run([sys.executable, "-m", "tf_sparsify", "what"], capture_output=True)
    assert usage.returncode == 2 and b"whatif" in usage.stderr


# -- the validation script -------------------------------------------------------------------------
def synthetic_rows(ranks: int, truth: dict) -> list[dict]:
    """Benchmark rows made by the validation's own model from known host terms: the script
    must recover them and predict every rated row exactly."""
    payloads = {"identity": 40_083_496, "fp16": 20_041_748, "topk1": 508_118}
    payloads["exchange_topk1"] = payloads["topk1"]
    calibration = wv.Calibration(truth["t0"], truth["host"], {})
    rows = []
    for rate in ("unlimited", "1gbit", "10gbit"):
        link = wv.host_link(rate, calibration)
        compute = truth["compute"][rate]
        row = {"backend": "horovod", "model": "mlp10m", "rate": rate, "ranks": ranks}
        rows.append({**row, "compressor": "compute", "best_ms": 1e3 * compute, "bytes_per_step": 0})
        for name, payload in payloads.items():
            entry = {**row, "compressor": name, "bytes_per_step": payload}
            spent = wv.comm(name, entry, link)
            if name != "exchange_topk1":
                spent += compute + truth["overheads"][name]
            rows.append({**entry, "best_ms": 1e3 * spent})
    return rows


@pytest.mark.parametrize("ranks", [2, 4])
def test_validation_recovers_a_synthetic_calibration(ranks):
    truth = {
        "t0": 0.01,
        "host": 5e8,
        "compute": {"unlimited": 0.2, "1gbit": 0.25, "10gbit": 0.22},
        "overheads": {"identity": 0.0, "fp16": 0.05, "topk1": 0.04},
    }
    rows = synthetic_rows(ranks, truth)
    rows.append({**rows[0], "backend": "mwms"})  # ignored
    results, notes = wv.validate(rows)
    assert len(results) == 2 * 4 and all(abs(r["error"]) < 1e-9 for r in results)
    calibration = wv.calibrate(wv.by_job(rows)[("mlp10m", ranks)]["unlimited"])
    assert calibration.call_overhead == pytest.approx(0.01)
    assert calibration.host_bandwidth == pytest.approx(5e8)
    assert calibration.overheads == pytest.approx(truth["overheads"])
    assert "call overhead 10.0 ms" in notes[0]
    # 1gbit dense at P = 2 by hand: both ranks' 40 MB through one limit, less the burst
    if ranks == 2:
        (dense,) = [r for r in results if r["rate"] == "1gbit" and r["compressor"] == "identity"]
        wire = (2 * 40_083_496 - 512 * 1024) / GBIT
        assert dense["predicted_ms"] == pytest.approx(1e3 * (0.25 + 0.01 + wire))


def test_validation_script_main(tmp_path, capsys):
    truth = {
        "t0": 0.005,
        "host": 3e8,
        "compute": {"unlimited": 0.1, "1gbit": 0.1, "10gbit": 0.1},
        "overheads": {"identity": 0.0, "fp16": 0.02, "topk1": 0.03},
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": synthetic_rows(2, truth)}))
    assert wv.main([str(path), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| mlp10m | 2 | 1gbit | identity |" in out and "8/8 within 25%" in out
    no_unlimited = [r for r in synthetic_rows(2, truth) if r["rate"] != "unlimited"]
    path.write_text(json.dumps({"rows": no_unlimited}))
    assert wv.main([str(path)]) == 1
    assert "skipped" in capsys.readouterr().out
