"""Old import paths (before the package was arranged in layers), kept for one release.

``import tf_sparsify.pipeline`` still works: it gives the module at its new path
(``tf_sparsify.core.pipeline``) and warns once with a ``DeprecationWarning`` naming it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: old module path -> new module path (0.1.x -> 0.2; the old paths go in 0.3)
MOVED = {
    "tf_sparsify.pipeline": "tf_sparsify.core.pipeline",
    "tf_sparsify.state": "tf_sparsify.core.state",
    "tf_sparsify.options": "tf_sparsify.core.options",
    "tf_sparsify.transports": "tf_sparsify.core.transport",
    "tf_sparsify.checkpointing": "tf_sparsify.core.checkpoint",
    "tf_sparsify.replica_values": "tf_sparsify.core.replica_values",
    "tf_sparsify.measurements": "tf_sparsify.core.measurements",
    "tf_sparsify.sparse_rows": "tf_sparsify.core.routes.sparse_rows",
    "tf_sparsify.memory": "tf_sparsify.compressors.error_memory",
    "tf_sparsify.compressors.protocol": "tf_sparsify.compressors.rounds",
    "tf_sparsify.exchange": "tf_sparsify.custom_loop.gradient_exchange",
    "tf_sparsify.whatif": "tf_sparsify.analysis.whatif",
    "tf_sparsify.whatif_cli": "tf_sparsify.analysis.whatif_cli",
    "tf_sparsify.ops.numpy_reference": "tf_sparsify.testing.numpy_reference",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new path."""

    def __init__(self):
        #: new path -> the module's own ``(__spec__, __loader__)``
        self._own: dict[str, tuple] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"`{spec.name}` moved to `{new}`; the old path will be removed in tf_sparsify 0.3.",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._own[new] = (module.__spec__, module.__loader__)
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path ran already. Its own spec and loader,
        which the import system just set to the old path's, are put back."""
        module.__spec__, module.__loader__ = self._own[module.__name__]


def install() -> None:
    """Let the old paths import (once per process)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())


def renamed(namespace: dict, old_names: dict[str, str]):
    """A module ``__getattr__`` that gives ``namespace[new]`` for each ``old -> new`` name
    and warns once with a ``DeprecationWarning`` naming both (old names kept one release)."""

    def __getattr__(name: str):
        if name not in old_names:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        new = old_names[name]
        warnings.warn(
            f"`{namespace['__name__']}.{name}` is now `{new}`; the old name will be removed in "
            "tf_sparsify 0.3.",
            DeprecationWarning,
            stacklevel=2,
        )
        return namespace[new]

    return __getattr__


def moved_names(module: str, homes: dict[str, str]):
    """A module ``__getattr__`` for names that moved to other modules: ``homes`` maps each old
    name to its new module; the name is looked up there, with a ``DeprecationWarning`` (kept one
    release)."""

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"`{module}.{name}` is now `{homes[name]}.{name}`; the old path will be removed in "
            "tf_sparsify 0.3.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(homes[name]), name)

    return __getattr__
