"""Classes by name, for configs: ``{"class_name": ..., "config": ...}`` and back."""

from __future__ import annotations

from typing import Any


class Registry:
    """The classes of one kind (``what``: "compressor", "server") that configs may name."""

    def __init__(self, what: str, base: type):
        self.what = what
        self.base = base
        self.classes: dict[str, type] = {}

    def add(self, cls: type) -> type:
        """Register ``cls`` under its name (usable as a decorator)."""
        self.classes[cls.__name__] = cls
        return cls

    @staticmethod
    def serialize(obj: Any) -> dict[str, Any]:
        """``{"class_name": ..., "config": ...}`` of an object with ``get_config``."""
        return {"class_name": type(obj).__name__, "config": obj.get_config()}

    def deserialize(self, config: Any) -> Any:
        """Inverse of :meth:`serialize` (the class's ``from_config``); an instance of the base
        passes through; a ValueError names an unknown class and the known ones."""
        if isinstance(config, self.base):
            return config
        name = config.get("class_name") if isinstance(config, dict) else None
        if name not in self.classes:
            raise ValueError(f"Unknown {self.what}: {config!r}. Known: {sorted(self.classes)}")
        return self.classes[name].from_config(config.get("config", {}))
