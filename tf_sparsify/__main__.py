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
    "install-horovod": "build Horovod 0.28.1 (TensorFlow + Gloo) into this Python's environment "
    "(needs cmake and a C++ compiler; about 1.5 minutes on 2 cores)",
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
    if args.command == "install-horovod":
        return install_horovod(args.dry_run)
    p.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
