"""``python -m tf_sparsify``: the command line (``--help`` lists the commands, ``--version``)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import tf_sparsify

#: each command and what it does, as ``--help`` lists them
COMMANDS = {
    "info": "which compiled kernels are loaded, whence (wheel or source build), for which "
    "devices and CUDA versions",
    "whatif": "predicted step time of each exchange method on a network "
    "(python -m tf_sparsify whatif --help)",
    "probe-link": "measure the link with all-reduces of a few sizes, under horovodrun; write "
    "what was measured as JSON for `whatif --link`",
    "install-horovod": "build Horovod 0.28.1 (TensorFlow + Gloo) into this Python's environment "
    "(needs cmake and a C++ compiler; about 1.3 minutes on 2 cores)",
}
#: the Horovod installer the package ships (a checkout's scripts/install_horovod.sh links to it)
HOROVOD_INSTALLER = Path(tf_sparsify.__file__).resolve().parent / "install_horovod.sh"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tf_sparsify",
        description="tf_sparsify: communication-efficient distributed training for TensorFlow "
        "and Keras 3.",
    )
    p.add_argument("--version", action="version", version=f"tf_sparsify {tf_sparsify.__version__}")
    commands = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary in COMMANDS.items():
        command = commands.add_parser(
            name, help=summary, description=summary, add_help=name != "whatif"
        )
        if name == "probe-link":
            command.add_argument("--out", help="the JSON file rank 0 writes (default: none)")
            command.add_argument("--repeats", type=int, default=5, help="timed calls per size")
        if name == "install-horovod":
            command.add_argument(
                "--dry-run",
                action="store_true",
                help="check what is installed and what the build needs, say what would be done, "
                "and stop before downloading or installing anything",
            )
    return p


def install_horovod(dry_run: bool) -> int:
    """Runs :data:`HOROVOD_INSTALLER` for this interpreter's environment; its exit status."""
    command = ["bash", str(HOROVOD_INSTALLER), sys.executable]
    return subprocess.run(command + (["--dry-run"] if dry_run else [])).returncode


def probe_link(out: str | None, repeats: int) -> int:
    """Measures the link under ``horovodrun`` (every rank runs it); rank 0 prints the fitted
    link and writes the measurement to ``out``."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as error:
        print(f"probe-link runs under horovodrun and needs Horovod: {error}", file=sys.stderr)
        return 2
    from tf_sparsify.core.link_probe import measure_link
    from tf_sparsify.horovod.collective import HorovodCollective

    hvd.init()
    if hvd.size() < 2:
        print("probe-link needs 2 or more ranks: horovodrun -np 2 ...", file=sys.stderr)
        return 2
    measured = measure_link(HorovodCollective(), repeats=repeats)
    if hvd.rank() == 0:
        link = measured.link()
        print(
            f"{measured.workers} ranks: {8 * link.bandwidth / 1e9:.3g} Gbit/s, "
            f"{1e6 * link.call_overhead:.0f} us per call"
        )
        if out:
            Path(out).write_text(measured.to_json())
            print(f"wrote {out}")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["whatif"]:  # its own options, parsed by the what-if's parser
        from tf_sparsify.analysis import whatif_cli

        return whatif_cli.main(argv[1:])
    p = parser()
    args = p.parse_args(argv)
    if args.command == "info":
        from tf_sparsify import ops

        print(ops.info())
        return 0
    if args.command == "probe-link":
        return probe_link(args.out, args.repeats)
    if args.command == "install-horovod":
        return install_horovod(args.dry_run)
    p.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
