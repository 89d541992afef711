"""``python -m tf_sparsify whatif`` (``tf_sparsify.analysis.whatif_cli``): each method's row and
the winner, the units of the options, a sweep through the module entry point; and bad or
contradictory options end in argparse's error (exit code 2, a message on stderr naming the
option and the value as given), never a traceback, a message in other units or under another
name, or an option silently ignored."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.script_runner import ROOT
from tf_sparsify.analysis import whatif_cli as cli
from tf_sparsify.step_model.link_fit import LinkMeasurement

BASE = ["--compute-ms", "100", "--params", "25M"]


def cli_error(argv: list[str], capsys) -> str:
    """stderr of a run that must end in argparse's error."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    assert "error: " in captured.err
    return captured.err


def step_ms(argv: list[str], capsys, method: str = "dense") -> str:
    """The step ms of ``method``'s row of the table."""
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith(f"{method} ")]
    return row.split()[3]


# -- runs ----------------------------------------------------------------------------------------
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


def test_cli_late_buckets(capsys):
    """The first layer's exchange one step late never slows TopK's step (backprop overlap)."""
    argv = ["--compute-ms", "55", "--model", "mlp10m", "--workers", "2", "--bandwidth", "1gbit"]
    argv += ["--overlap", "backprop", "--methods", "dense,topk"]
    now = float(step_ms([*argv, "--late-buckets", "none"], capsys, "topk"))
    assert cli.main([*argv, "--late-buckets", "last"]) == 0
    out = capsys.readouterr().out
    assert "overlap backprop, late buckets last," in out.splitlines()[0]
    (row,) = [line for line in out.splitlines() if line.startswith("topk ")]
    assert float(row.split()[3]) <= now
    assert cli.main(argv) == 0 and "late buckets" not in capsys.readouterr().out
    err = cli_error([*argv, "--late-buckets", "some"], capsys)
    assert "argument --late-buckets" in err and "'some'" in err


def test_cli_auto_says_what_each_tensor_would_be_sent_with(capsys):
    """mlp10m on 1 Gbit/s: every tensor at TopK 1%, the biases and the small last kernel
    riding with their bucket's TopK (an all-reduce of their own would cost its rounds). TopK
    0.1% on the first layers would make the step 58.1 ms: within the 2 % the least compression
    may add, so it is not taken. The rows add up to the model, and the step is the choice's."""
    argv = ["--compute-ms", "55", "--model", "mlp10m", "--workers", "2", "--bandwidth", "1gbit"]
    argv += ["--overhead-ms", "fp16=1,topk=3", "--auto"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-2].split() == ["topk1%", "8", "10,020,874", "0-7"]
    assert out.splitlines()[-3].startswith("-----")  # the only row
    assert out.splitlines()[-1].startswith("auto: 58.7 ms/step (compute 55.0, compression 3.0)")
    assert cli.main([*argv, "--auto-ratios", "0.05", "--late-buckets", "all"]) == 0
    out = capsys.readouterr().out
    assert "topk0.1%" not in out and out.splitlines()[-1].endswith("hides under compute")


def test_cli_link_takes_a_measured_link(tmp_path, capsys):
    """``--link`` (what ``probe-link`` wrote): 2 workers, 1 Gbit/s and 200 us per call."""
    link = tmp_path / "link.json"
    sizes = (4096, 65536, 1048576)
    link.write_text(LinkMeasurement(2, sizes, tuple(2e-4 + m / 1.25e8 for m in sizes)).to_json())
    argv = ["--compute-ms", "55", "--model", "mlp10m", "--link", str(link), "--auto"]
    assert cli.main(argv) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "P = 2, 1 Gbit/s, alpha 0 us" in head
    assert "P = 8," in cli_main_out([*argv, "--workers", "8"], capsys)
    assert "drop --bandwidth" in cli_error([*argv, "--bandwidth", "10gbit"], capsys)
    link.write_text("{}")
    assert f"--link {str(link)!r}: expected a JSON object" in cli_error(argv, capsys)
    assert "No such file" in cli_error([*argv[:-3], "--link", str(tmp_path / "no.json")], capsys)


def test_cli_host_work_counts_the_measured_cpu_time_of_the_exchange(tmp_path, capsys):
    """``--host-work``: the exchange's CPU time per call and per byte (``cpu_seconds``, here
    half of 1 Gbit/s's wire time per byte) is compute the exchange cannot hide under, so Auto
    sends the big kernels at the most compression (not only TopK 1%) and predicts a longer
    step."""
    link = tmp_path / "link.json"
    sizes = (4096, 65536, 1048576)
    wire, cpu = (tuple(a + m / b for m in sizes) for a, b in ((2e-4, 1.25e8), (1e-4, 5e8)))
    link.write_text(LinkMeasurement(2, sizes, wire, cpu).to_json())
    argv = ["--compute-ms", "55", "--model", "mlp10m", "--link", str(link), "--auto"]
    plain, counted = cli_main_out(argv, capsys), cli_main_out([*argv, "--host-work"], capsys)
    assert "\ntopk1%            8 " in plain and "\ntopk0.1%" not in plain
    assert "\ntopk0.1%          6    8,413,194" in counted
    step = [float(out.splitlines()[-1].split()[1]) for out in (plain, counted)]
    assert step == [55.9, 56.3]
    assert "--host-work needs --auto" in cli_error([*argv[:-1], "--host-work"], capsys)
    link.write_text(LinkMeasurement(2, sizes, wire).to_json())
    assert "measured with CPU times" in cli_error([*argv, "--host-work"], capsys)


def cli_main_out(argv: list[str], capsys) -> str:
    assert cli.main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--auto", "--sweep"], "--auto chooses for one cluster"),
        (["--auto-ratios", "0.01"], "--auto-ratios applies only with --auto"),
        (["--auto", "--auto-ratios", "0.01,2"], "argument --auto-ratios: '0.01,2'"),
        (["--auto", "--auto-ratios", "0.01,0.01"], "argument --auto-ratios: '0.01,0.01'"),
        (["--auto", "--auto-ratios", ","], "argument --auto-ratios: ','"),
    ],
)
def test_cli_auto_bad_options(extra, expected, capsys):
    workers = [] if "--sweep" in extra else ["--workers", "2"]
    assert expected in cli_error([*BASE, *workers, *extra], capsys)


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


# -- bad or contradictory options ---------------------------------------------------------------
# 1. --burst only applies to a shared medium
def test_burst_without_shared_medium_is_an_error(capsys):
    argv = [*BASE, "--workers", "8", "--methods", "dense"]
    plain = step_ms(argv, capsys)
    err = cli_error([*argv, "--burst", "100MB"], capsys)
    assert "--burst" in err and "--shared-medium" in err and "104,857,600 bytes" in err
    # with --shared-medium the burst counts: it shortens the shared-medium step
    shared = step_ms([*argv, "--shared-medium"], capsys)
    burst = step_ms([*argv, "--shared-medium", "--burst", "100MB"], capsys)
    assert float(burst) < float(shared) and float(plain) < float(shared)
    assert step_ms([*argv, "--burst", "0"], capsys) == plain  # no burst: nothing asked


# 2. an empty --sweep-bandwidths
@pytest.mark.parametrize(
    "value, expected",
    [("", "expected a comma list"), (",", "expected a comma list"), ("1gbit,fast", "'fast'")],
)
def test_sweep_bandwidths_bad_list(value, expected, capsys):
    err = cli_error([*BASE, "--sweep", "--sweep-bandwidths", value], capsys)
    assert f"--sweep-bandwidths {value!r}" in err and expected in err


def test_sweep_bandwidths_repeated(capsys):
    err = cli_error([*BASE, "--sweep", "--sweep-bandwidths", "1gbit,1000mbit"], capsys)
    assert "--sweep-bandwidths '1gbit,1000mbit'" in err and "'1000mbit' repeats" in err


# 3. an empty --methods
@pytest.mark.parametrize("value", ["", ",", " , "])
def test_methods_empty(value, capsys):
    err = cli_error([*BASE, "--workers", "8", "--methods", value], capsys)
    assert "--methods" in err and "expected a comma list of methods" in err and "dense" in err
    assert "min()" not in err


def test_methods_repeated(capsys):
    err = cli_error([*BASE, "--workers", "8", "--methods", "dense,topk,dense"], capsys)
    assert "--methods" in err and "'dense' given twice" in err


# 4. --workers 0 is reported as --workers
def test_workers_zero_names_workers(capsys):
    err = cli_error([*BASE, "--workers", "0"], capsys)
    assert "argument --workers" in err and "got '0'" in err and "`nodes`" not in err


@pytest.mark.parametrize("option", ["--nodes", "--gpus-per-node"])
def test_node_counts_below_one_name_their_option(option, capsys):
    other = [] if option == "--nodes" else ["--nodes", "2"]
    err = cli_error([*BASE, *other, option, "0"], capsys)
    assert f"argument {option}" in err and "got '0'" in err


def test_sweep_gpus_per_node_zero_or_too_many(capsys):
    err = cli_error([*BASE, "--sweep", "--gpus-per-node", "0"], capsys)  # was ZeroDivisionError
    assert "argument --gpus-per-node" in err and "got '0'" in err
    err = cli_error([*BASE, "--sweep", "--gpus-per-node", "2048"], capsys)  # was IndexError
    assert "--gpus-per-node 2048" in err and "--sweep" in err


# 5. --compute-ms is reported in ms
@pytest.mark.parametrize("value", ["-100", "nan", "inf", "fast"])
def test_compute_ms_bad_value_in_ms(value, capsys):
    err = cli_error(["--compute-ms", value, "--params", "25M", "--workers", "8"], capsys)
    assert "argument --compute-ms" in err and f"got {value!r}" in err and "-0.1" not in err


# 6. --plot (and --sweep-bandwidths) without --sweep
@pytest.mark.parametrize(
    "option, value", [("--plot", "sweep.png"), ("--sweep-bandwidths", "1gbit")]
)
def test_sweep_options_without_sweep(option, value, capsys):
    err = cli_error([*BASE, "--workers", "8", option, value], capsys)
    assert f"{option} {value!r}" in err and "--sweep" in err


def test_plot_must_be_a_png(capsys, tmp_path):
    err = cli_error([*BASE, "--sweep", "--plot", str(tmp_path / "sweep.jpg")], capsys)
    assert "--plot" in err and "sweep.jpg" in err and ".png" in err
    (tmp_path / "folder.png").mkdir()
    err = cli_error([*BASE, "--sweep", "--plot", str(tmp_path / "folder.png")], capsys)
    assert "--plot" in err and "folder" in err


# 7. a method's overhead given twice
@pytest.mark.parametrize(
    "argv",
    [
        ["--overhead-ms", "topk=3", "--overhead-ms", "topk=5"],
        ["--overhead-ms", "topk=3,topk=5"],
        ["--overhead-ms", "qsgd=1,topk=3", "--overhead-ms", "topk=5"],
    ],
)
def test_overhead_ms_repeated_key(argv, capsys):
    err = cli_error([*BASE, "--workers", "8", *argv], capsys)
    assert "--overhead-ms" in err and "'topk' given twice ('topk=3', then 'topk=5')" in err


def test_overhead_ms_repeated_option_adds_up():
    """Each --overhead-ms adds its methods (the second no longer replaces the first)."""
    argv = [*BASE, "--workers", "8", "--overhead-ms", "topk=3", "--overhead-ms", "qsgd=5"]
    assert cli.parse_args(argv).overhead_ms == {"topk": 0.003, "qsgd": 0.005}


@pytest.mark.parametrize(
    "value, expected",
    [
        ("topk=-5", "'topk=-5': expected METHOD=MS"),  # was "got -0.005" (seconds)
        ("topk=5ms", "'topk=5ms'"),
        ("topk", "'topk'"),
        ("", "'': expected METHOD=MS"),
        ("nope=5", "'nope' is not among --methods"),  # was "`overheads` names methods"
    ],
)
def test_overhead_ms_bad_items(value, expected, capsys):
    err = cli_error([*BASE, "--workers", "8", "--overhead-ms", value], capsys)
    assert "--overhead-ms" in err and expected in err and "-0.005" not in err


# -- the other options ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--ratio", "0"], ["argument --ratio", "got '0'"]),
        (["--ratio", "1.5"], ["argument --ratio", "got '1.5'"]),
        (["--value-bytes", "0"], ["argument --value-bytes", "got '0'"]),
        (["--index-bytes", "nan"], ["argument --index-bytes", "got 'nan'"]),
        (["--levels", "40000"], ["argument --levels", "got '40000'"]),
        (["--levels", "0"], ["argument --levels", "got '0'"]),
        (["--rank", "0"], ["argument --rank", "got '0'"]),
        (["--call-overhead", "5"], ["argument --call-overhead", "'5'"]),
        (["--intra-latency", "5", "--gpus-per-node", "2"], ["argument --intra-latency", "'5'"]),
        (["--host-bandwidth", "0gbit"], ["argument --host-bandwidth", "'0gbit'"]),
        (["--burst", "lots", "--shared-medium"], ["argument --burst", "'lots'"]),
        (["--bandwidth", "1" + "0" * 400 + "gbit"], ["argument --bandwidth", "too large"]),
    ],
)
def test_bad_values_name_their_option_and_value(argv, expected, capsys):
    nodes = ["--nodes", "4"] if "--gpus-per-node" in argv else ["--workers", "8"]
    err = cli_error([*BASE, *nodes, *argv], capsys)
    for text in expected:
        assert text in err
    assert "latency '5'" not in err  # the old message named --latency for every duration


@pytest.mark.parametrize("value", ["0", "1.5", "0.4", "99999999999G"])
def test_params_must_be_a_whole_positive_count(value, capsys):
    err = cli_error(["--compute-ms", "1", "--params", value, "--workers", "8"], capsys)
    assert "argument --params" in err and f"{value!r}" in err and "num_params" not in err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--methods", "dense", "--ratio", "0.1"], "--ratio 0.1 has no effect"),
        (["--methods", "dense,topk", "--levels", "8"], "--levels 8 has no effect"),
        (["--methods", "qsgd", "--rank", "2"], "--rank 2 has no effect"),
        (["--intra-bandwidth", "100gbit"], "--intra-bandwidth"),
        (["--intra-latency", "1us"], "--intra-latency"),
    ],
)
def test_options_without_effect(argv, expected, capsys):
    err = cli_error([*BASE, "--workers", "8", *argv], capsys)
    assert expected in err


def test_workers_with_gpus_per_node(capsys):
    """--workers is one GPU per node: with --gpus-per-node it would have meant nodes."""
    err = cli_error([*BASE, "--workers", "16", "--gpus-per-node", "8"], capsys)
    assert "--workers 16" in err and "--gpus-per-node 8" in err and "--nodes" in err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--workers", "8"], "drop --workers 8"),
        (["--nodes", "4", "--gpus-per-node", "2"], "drop --nodes 4"),
        (["--bandwidth", "1gbit"], "drop --bandwidth"),
    ],
)
def test_sweep_ignores_nothing(argv, expected, capsys):
    err = cli_error([*BASE, "--sweep", *argv], capsys)
    assert "--sweep" in err and expected in err


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "No such file"),
        ("{", "Expecting"),
        ("[]", "at least one"),
        ("[[3, 0]]", "(3, 0)"),
        ('{"a": 1}', "JSON list"),
        (json.dumps([10**40]), "at most 2^63 - 1"),
    ],
)
def test_layers_file_errors_name_layers(content, expected, tmp_path, capsys):
    path = tmp_path / "layers.json"
    if content is not None:
        path.write_text(content)
    argv = ["--compute-ms", "1", "--layers", str(path), "--workers", "8"]
    err = cli_error(argv, capsys)
    assert f"--layers {str(path)!r}" in err and expected in err


def test_layers_help_asks_for_a_file():
    help_text = " ".join(cli.build_parser().format_help().split())
    assert "--layers FILE.json JSON file holding a list of tensor shapes or sizes" in help_text


# -- the tables -----------------------------------------------------------------------------------
def cell_ends(line: str) -> list[int]:
    """Where each cell of a table line ends (cells hold single spaces, columns two or more)."""
    return [m.end() for m in re.finditer(r"\S+(?: \S+)*", line)]


def test_table_columns_stay_apart_at_one_bit_per_second(capsys):
    """13-digit ms still sit under their headers, right-aligned, with spaces between."""
    assert cli.main([*BASE, "--workers", "8", "--bandwidth", "1bit"]) == 0
    _, head, rule, *rows, winner = capsys.readouterr().out.splitlines()
    assert len(rule) == len(head) and winner.startswith("winner: ")
    for row in rows:
        cells = row.split()
        assert len(cells) == 5 and float(cells[2]) > 1e9, row  # comm ms
        assert cell_ends(row)[1:] == cell_ends(head)[1:], row


def test_sweep_table_columns_stay_apart_at_one_bit_per_second(tmp_path, capsys):
    argv = [*BASE, "--sweep", "--sweep-bandwidths", "1bit,10gbit", "--plot"]
    assert cli.main([*argv, str(tmp_path / "sweep.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("P "))
    head, rows = lines[at], lines[at + 1 : -1]
    assert len(rows) == 10  # P = 2, 4, ..., 1024
    for row in rows:
        assert len(row.split()) == 7 and cell_ends(row) == cell_ends(head), row


def test_parse_functions_raise_value_errors():
    """Outside argparse the parse_* functions still raise ValueError (and name the text)."""
    for parse, text in (
        (cli.parse_bandwidth, "10gbps"),
        (cli.parse_duration, "5"),
        (cli.parse_size, "lots"),
        (cli.parse_count, "0"),
        (cli.parse_overheads, "topk=-1"),
        (cli.parse_overheads, "topk=1,topk=2"),
    ):
        with pytest.raises(ValueError, match="'"):
            parse(text)
