"""``python -m benchmarks.network``: see :mod:`benchmarks.network.run`."""

import sys

from benchmarks.network.run import main

sys.exit(main())
