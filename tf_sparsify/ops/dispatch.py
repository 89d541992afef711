"""The one choice between an op's compiled kernel and its pure-TF reference.

Every op of :mod:`tf_sparsify.ops` checks its arguments first, then hands :func:`run` its
kernel call and its reference call. :func:`run` calls the kernel with the loaded op module
(the library :mod:`tf_sparsify.ops.library` loads, once), and the reference instead:

* traced for XLA (``jit_compile=True``, :func:`~tf_sparsify.ops.xla.in_xla_context`), where no
  custom kernel can run: silently, also under ``TF_SPARSIFY_REQUIRE_OPS=1``;
* when the library did not load: after a one-time RuntimeWarning saying why, or, with
  ``TF_SPARSIFY_REQUIRE_OPS=1``, not at all: RuntimeError;
* when the op says that its kernel does not take these inputs (``kernel_takes=False``: a
  CPU-only kernel's tensor on a GPU, a dtype it lacks): silently, the library not consulted.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import tensorflow as tf

from tf_sparsify.ops import library
from tf_sparsify.ops.xla import in_xla_context

REQUIRE_ENV = "TF_SPARSIFY_REQUIRE_OPS"

#: whether the fallback has been warned about (once per process)
warned = False

T = TypeVar("T")


@functools.cache
def loaded_library() -> library.Library:
    """What loading the library found (loaded on the first call; ``tf_sparsify.ops`` makes it
    at import)."""
    return library.load()


def is_compiled() -> bool:
    """Whether the compiled kernels are loaded."""
    return loaded_library().module is not None


def compiled_module() -> Any:
    """The loaded op module; None under XLA (silently: the reference compiles there) or, after
    warning once, when it did not load (error under TF_SPARSIFY_REQUIRE_OPS)."""
    global warned
    if in_xla_context():
        return None
    lib = loaded_library()
    if lib.module is not None:
        return lib.module
    if os.environ.get(REQUIRE_ENV) == "1":
        raise RuntimeError(f"{REQUIRE_ENV}=1 but the compiled ops are unavailable: {lib.reason}")
    if not warned:
        warned = True
        warnings.warn(
            f"tf_sparsify: compiled ops unavailable ({lib.reason}); using the pure-TF reference",
            RuntimeWarning,
            stacklevel=4,  # the op's caller (this function < run < the op)
        )
    return None


def run(kernel: Callable[[Any], T], reference: Callable[[], T], *, kernel_takes: bool = True) -> T:
    """``kernel(module)`` with the loaded op module, or ``reference()`` where the module
    docstring says; ``kernel_takes=False`` chooses the reference without asking for the
    library."""
    module = compiled_module() if kernel_takes else None
    return reference() if module is None else kernel(module)


def runs_on_cpu(tensor: tf.Tensor) -> bool:
    """Whether ``tensor`` is (or, placed by TensorFlow, will be) on a CPU: its device when
    known, else whether TensorFlow sees no GPU."""
    device = getattr(tensor, "device", "") or ""
    if device:
        return "CPU" in device.upper()
    return not tf.config.list_logical_devices("GPU")
