"""``horovod.tensorflow``, or an ImportError that says how to get it."""

from __future__ import annotations

try:
    import horovod.tensorflow as hvd
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tf_sparsify.horovod needs Horovod built for TensorFlow (`import horovod.tensorflow` "
        f"failed: {error}). Build it into this environment with `python -m tf_sparsify "
        "install-horovod` (from a clone: `make horovod`)."
    ) from error

__all__ = ["hvd"]
