"""``python -m tf_sparsify info``: which compiled kernels are loaded, for which devices.
``python -m tf_sparsify whatif ...``: predicted step time of each exchange method
(see :mod:`tf_sparsify.whatif_cli`)."""

import sys

USAGE = "usage: python -m tf_sparsify {info | whatif [--help] ...}"


def main(argv: list[str]) -> int:
    if argv == ["info"]:
        from tf_sparsify import ops

        print(ops.info())
        return 0
    if argv[:1] == ["whatif"]:
        from tf_sparsify import whatif_cli

        return whatif_cli.main(argv[1:])
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
