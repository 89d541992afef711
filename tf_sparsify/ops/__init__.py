"""Custom ops: fused TopK with error feedback, QSGD quantization, a dense scatter-sum, the
Elias-Fano code of TopK's indices, a plain SGD step from sparse updates, a 16-bit cast with
error feedback and the sum of gathered 16-bit payloads.

Each function runs the compiled kernels (built by ``python -m tf_sparsify.ops.build``, loaded by
:mod:`tf_sparsify.ops.library`) when they load, and otherwise the pure-TF reference in
:mod:`tf_sparsify.ops.pure_tf`, which gives identical results, with a one-time warning. With
``TF_SPARSIFY_REQUIRE_OPS=1`` a missing library raises RuntimeError instead. Traced for XLA
(``jit_compile=True``, see :mod:`tf_sparsify.ops.xla`), where no custom kernel can run, the
reference runs silently (also under ``TF_SPARSIFY_REQUIRE_OPS=1``), without the run-time check
of ``scatter_sum``'s indices (XLA raises no errors at run time). That choice is made in one
place, :mod:`tf_sparsify.ops.dispatch`. Arguments are checked before it, for both paths;
invalid ones raise InvalidArgumentError naming the argument.

The numerics every path shares (CPU kernel, CUDA core, pure-TF reference, NumPy model): the
denormal policy, QSGD's saturation and bfloat16's rounding and NaNs, are those of
:mod:`tf_sparsify.ops.pure_tf`.

The ops by family: :mod:`~tf_sparsify.ops.topk`, :mod:`~tf_sparsify.ops.qsgd`,
:mod:`~tf_sparsify.ops.scatter` (ScatterSum and the index codes), :mod:`~tf_sparsify.ops.sgd`
and :mod:`~tf_sparsify.ops.casts`; :func:`info` is :mod:`tf_sparsify.ops.status`'.
"""

from __future__ import annotations

import sys
import types

# The dtype lists, importable from here as before.
from tf_sparsify.common.dtypes import FLOAT_DTYPES, INDEX_DTYPES, WIRE_DTYPES  # noqa: F401
from tf_sparsify.ops import dispatch, index_code, library, pure_tf  # noqa: F401
from tf_sparsify.ops.casts import saturating_cast_feedback, wire_sum, wire_to_float
from tf_sparsify.ops.dispatch import REQUIRE_ENV, is_compiled  # noqa: F401
from tf_sparsify.ops.qsgd import MAX_LEVELS, qsgd_dequantize, qsgd_quantize  # noqa: F401
from tf_sparsify.ops.scatter import (
    decode_indices,
    decode_indices_packed,
    encode_indices,
    encode_indices_packed,
    packed_decompress_sum,
    scatter_sum,
)
from tf_sparsify.ops.sgd import sparse_sgd_apply, sparse_sgd_apply_packed
from tf_sparsify.ops.status import OpsInfo, info
from tf_sparsify.ops.topk import (  # noqa: F401
    GPU_MAX_ELEMENTS,
    topk_error_feedback,
    topk_error_feedback_packed,
)
from tf_sparsify.ops.xla import in_xla_context

__all__ = [
    "OpsInfo",
    "decode_indices",
    "encode_indices",
    "in_xla_context",
    "info",
    "is_compiled",
    "qsgd_dequantize",
    "qsgd_quantize",
    "saturating_cast_feedback",
    "scatter_sum",
    "sparse_sgd_apply",
    "topk_error_feedback",
    "topk_error_feedback_packed",
    "encode_indices_packed",
    "decode_indices_packed",
    "packed_decompress_sum",
    "wire_to_float",
    "wire_sum",
    "sparse_sgd_apply_packed",
]

# Load at import so that graphs and SavedModels using the ops can be imported right away.
dispatch.loaded_library()


def _dispatch_attribute(name: str) -> property:
    return property(
        lambda _: getattr(dispatch, name),
        lambda _, value: setattr(dispatch, name, value),
        doc=f"tf_sparsify.ops.dispatch.{name}",
    )


class _Package(types.ModuleType):
    """``tf_sparsify.ops`` itself. The loader's state, under the names it had here before it
    moved to :mod:`tf_sparsify.ops.dispatch` (tests replace them to run the reference, or to
    pretend that the library is missing), reads and writes dispatch's."""

    _library = _dispatch_attribute("loaded_library")
    _compiled = _dispatch_attribute("compiled_module")
    _warned = _dispatch_attribute("warned")


sys.modules[__name__].__class__ = _Package
