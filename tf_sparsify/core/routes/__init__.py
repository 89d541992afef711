"""The routes a unit can travel by, one module each, offered in this order: a unit goes the
first route that claims it (:class:`~tf_sparsify.core.routes.route.Route`)."""

from tf_sparsify.core.routes.dense import DenseRoute
from tf_sparsify.core.routes.packed_topk import PackedTopKRoute
from tf_sparsify.core.routes.sparse_rows import SparseRowsRoute

_DENSE = DenseRoute()
#: sparse rows, then packed TopK buckets, then everything else
ROUTES = (SparseRowsRoute(), PackedTopKRoute(alone=_DENSE), _DENSE)
