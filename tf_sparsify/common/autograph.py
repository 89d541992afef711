"""AutoGraph leaves tf_sparsify's code as written, as it leaves TensorFlow's and Keras'.

The library's code runs in graphs unconverted already: Keras traces ``train_step`` with AutoGraph
off, so nothing in it may rely on conversion. In a user's ``tf.function`` (a custom loop, a
Horovod step) AutoGraph would still convert every function of the package on its first trace,
which costs seconds per process and changes nothing. TensorFlow keeps its "do not convert" list
in a private module; where it is missing, the code is converted as before, only traced slower.
"""

from __future__ import annotations

PACKAGE = "tf_sparsify"


def leave_unconverted() -> bool:
    """Puts the package on AutoGraph's "do not convert" list (once); whether it is on it."""
    try:
        from tensorflow.python.autograph.core import config, config_lib
    except ImportError:
        return False
    rule = config_lib.DoNotConvert(PACKAGE)
    if not any(str(r) == str(rule) for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (rule, *config.CONVERSION_RULES)
    return True
