"""Both Horovod digits examples in one launch, one after the other, with the arguments given
(a launch costs ~15 s of start-up on 2 cores): ``examples/horovod_keras_digits.py``
(``model.fit``) then ``examples/horovod_custom_loop.py``. Rank 0 prints ``EXAMPLE {name}``
before each, so their outputs can be told apart.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import horovod.tensorflow as hvd  # noqa: E402
import horovod_custom_loop  # noqa: E402
import horovod_keras_digits  # noqa: E402

import tf_sparsify.horovod as th  # noqa: E402

EXAMPLES = {"fit": horovod_keras_digits, "custom_loop": horovod_custom_loop}
MARKER = "EXAMPLE "


def main(argv: list[str]) -> None:
    hvd.init()
    for name, example in EXAMPLES.items():
        th.log0(MARKER + name)
        example.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
