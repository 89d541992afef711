"""``python -m tf_sparsify``: the command line (``--help`` lists the commands, ``--version``)."""

from __future__ import annotations

import argparse
import sys

import tf_sparsify

#: each command and what it does, as ``--help`` lists them
COMMANDS = {
    "info": "which compiled kernels are loaded, whence (wheel or source build), for which "
    "devices and CUDA versions",
    "whatif": "predicted step time of each exchange method on a network "
    "(python -m tf_sparsify whatif --help)",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tf_sparsify",
        description="tf_sparsify: communication-efficient distributed training for TensorFlow "
        "and Keras 3.",
    )
    p.add_argument("--version", action="version", version=f"tf_sparsify {tf_sparsify.__version__}")
    commands = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary in COMMANDS.items():
        commands.add_parser(name, help=summary, description=summary, add_help=name != "whatif")
    return p


def main(argv: list[str]) -> int:
    if argv[:1] == ["whatif"]:  # its own options, parsed by the what-if's parser
        from tf_sparsify import whatif_cli

        return whatif_cli.main(argv[1:])
    p = parser()
    args = p.parse_args(argv)
    if args.command == "info":
        from tf_sparsify import ops

        print(ops.info())
        return 0
    p.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
