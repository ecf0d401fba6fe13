"""One lazy registry of named factories, for every plug-in point of the platform and the
learner (backends, placement policies, notice sources, metric sources, ...).

A factory may be given as the object itself or as `"module:attr"`, imported on first
`get()`, so that a registry stays cheap to import and a plug-in's heavy dependencies are
loaded only when it is used.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Generic, TypeVar, cast

T = TypeVar("T")


class UnknownName(LookupError):
    """`get` of a name nobody registered; the message lists the registered ones."""


class Registry(Generic[T]):
    """Names -> factories of `T` (usually callables that build the plug-in).

    `kind` names what is registered, for the error message ("placement policy");
    `error` builds the exception `get` raises for an unknown name, so each registry
    keeps its own typed error; `load` imports the modules that register built-ins;
    `ordered` lists names in registration order (a CLI's default order) instead of sorted.
    """

    def __init__(
        self,
        kind: str,
        *,
        error: Callable[[str], Exception] = UnknownName,
        load: Callable[[], object] | None = None,
        ordered: bool = False,
    ) -> None:
        self.ordered = ordered
        self.kind = kind
        self._error = error
        self._load = load
        self._loaded = load is None
        self._entries: dict[str, T | str] = {}
        self._lock = threading.Lock()

    def register(self, name: str, factory: T | str) -> None:
        """Register `factory`, or `"module:attr"` to be imported on first use."""
        if isinstance(factory, str) and ":" not in factory:
            raise ValueError(f"{self.kind} {name!r}: a lazy factory is 'module:attr'")
        with self._lock:
            self._entries[name] = factory

    def _ensure_loaded(self) -> None:
        if not self._loaded:
            self._loaded = True  # first: a loader that registers must not recurse
            assert self._load is not None
            self._load()

    def get(self, name: str) -> T:
        self._ensure_loaded()
        with self._lock:
            target = self._entries.get(name)
        if target is None:
            raise self._error(self.unknown_message(name))
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            resolved = cast(T, getattr(importlib.import_module(module), attr))
            with self._lock:
                self._entries[name] = resolved
            return resolved
        return target

    def unknown_message(self, name: object) -> str:
        names = ", ".join(self.names()) or "none"
        return f"unknown {self.kind} {name!r}; choose one of the registered: {names}"

    def names(self) -> list[str]:
        self._ensure_loaded()
        with self._lock:
            return list(self._entries) if self.ordered else sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        with self._lock:
            return name in self._entries
