"""Transports by name: `[cluster] transport` picks one, the daemon makes it, config checks it.

The way vLLM's KVConnectorFactory registers its connectors: a registration is a name, the dotted
path of the module that holds the class, and the class's name. The module is imported only when
that transport is asked for (config validation of a `[cluster]` that names it, or the daemon
making it), never at registration: NIXL is an optional install, and naming every transport must
not import any of them. A new transport is one module (a `base.Transport` subclass) and one
`register_transport` line at the bottom of this file.

This module imports nothing heavier than `base` at import time, so that config.py can ask it for
the names (and the class of the one configured) without pulling in a transport's dependencies.
"""
from __future__ import annotations

import importlib
from typing import Any

from .base import Transport, TransportUnavailable


class UnknownTransport(ValueError):
    """No transport is registered under that name (the message lists the ones that are)."""


def quoted_names(names: tuple[str, ...]) -> str:
    """'"tcp" or "nixl"': how a refusal lists the registered names."""
    quoted = [f'"{name}"' for name in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


class TransportRegistry:
    """name -> (module path, class name), and the classes imported so far."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[str, str]] = {}
        self._classes: dict[str, type[Transport]] = {}

    def register(self, name: str, module_path: str, class_name: str) -> None:
        """File a transport under `name` without importing it; ValueError if the name is taken."""
        if name in self._entries:
            module, cls = self._entries[name]
            raise ValueError(f"transport {name!r} is already registered ({module}.{cls})")
        self._entries[name] = (module_path, class_name)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order (the default first)."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def transport_class(self, name: str) -> type[Transport]:
        """The class registered as `name`, importing its module on first use. UnknownTransport for
        a name never registered; TransportUnavailable when its module does not import or does not
        hold a Transport subclass of that name."""
        cls = self._classes.get(name)
        if cls is not None:
            return cls
        if name not in self._entries:
            raise UnknownTransport(f"unknown transport {name!r}: {quoted_names(self.names())}")
        module_path, class_name = self._entries[name]
        try:
            module = importlib.import_module(module_path)
        except ImportError as exc:
            raise TransportUnavailable(f"its module {module_path} does not import: {exc}") from None
        found = getattr(module, class_name, None)
        if not (isinstance(found, type) and issubclass(found, Transport)):
            raise TransportUnavailable(f"{module_path}.{class_name} is not a Transport class")
        self._classes[name] = found
        return found

    def make(self, name: str, **kwargs: Any) -> Transport:
        """A new transport of the class registered as `name`, made with `kwargs` (see
        base.Transport for the keywords every transport takes). UnknownTransport,
        TransportUnavailable (also from the constructor: a library missing here)."""
        return self.transport_class(name)(**kwargs)


# The daemon's transports. Tests make registries of their own rather than change this one.
TRANSPORTS = TransportRegistry()


def register_transport(name: str, module_path: str, class_name: str) -> None:
    """Register a transport by name (lazily imported: see the module docstring)."""
    TRANSPORTS.register(name, module_path, class_name)


def transport_names() -> tuple[str, ...]:
    """The names `[cluster] transport` accepts."""
    return TRANSPORTS.names()


def transport_class(name: str) -> type[Transport]:
    """The class of a registered transport (its module imported now): what config asks for the
    transport's own `[cluster]` checks and capabilities."""
    return TRANSPORTS.transport_class(name)


def make_transport(name: str, **kwargs: Any) -> Transport:
    """Make the transport registered as `name` (the daemon's Cluster does, at start)."""
    return TRANSPORTS.make(name, **kwargs)


# ---- the registrations: one line per transport --------------------------------------------------
register_transport("tcp", "ecd.transport.tcp", "TcpTransport")  # the default (ClusterSection.transport)
register_transport("nixl", "ecd.transport.nixl", "NixlTransport")  # optional install: imports NIXL when made
