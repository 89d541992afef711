"""``python -m tf_sparsify info``: which compiled kernels are loaded, for which devices."""

import sys

from tf_sparsify import ops


def main(argv: list[str]) -> int:
    if argv != ["info"]:
        print("usage: python -m tf_sparsify info", file=sys.stderr)
        return 2
    print(ops.info())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
