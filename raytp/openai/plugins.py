"""Named plug-ins (tool-call parsers, reasoning parsers): a table of name -> (module, class), each class in its
own module, imported only when its name is asked for, so an unused parser costs no import."""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

T = TypeVar("T")


class PluginTable(Generic[T]):
    def __init__(self, kind: str, rows: dict[str, tuple[str, str]]) -> None:
        self._kind = kind  # what a plug-in is, for the error ("tool-call parser")
        self._rows = rows  # name -> (module, class name)

    def names(self) -> list[str]:
        return sorted(self._rows)

    def check(self, name: str) -> None:
        """ValueError listing the registered names unless `name` is one (a config refuses it at start)."""
        if name not in self._rows:
            raise ValueError(f"unknown {self._kind} {name!r}; registered: {', '.join(self.names())}")

    def create(self, name: str) -> T:
        """A new instance of the plug-in `name` (ValueError as `check` for any other)."""
        self.check(name)
        module, cls = self._rows[name]
        plugin: T = getattr(importlib.import_module(module), cls)()
        return plugin
