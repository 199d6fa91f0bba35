"""The registry's index of READY entries by (namespace, key), one dict per namespace.

It answers exactly like a dict keyed by (namespace, key) tuples (get, in, [], del, values,
items, len) but does not keep such a tuple per entry: a flat dict would hold one (56 bytes) for
every entry, where this holds one dict per namespace (a few)."""
from __future__ import annotations

from types import MappingProxyType
from typing import Iterator, Mapping

from .entries import Entry

_NONE: Mapping[str, Entry] = MappingProxyType({})


class KeyIndex:
    __slots__ = ("_by_ns", "_len")

    def __init__(self) -> None:
        self._by_ns: dict[str, dict[str, Entry]] = {}
        self._len = 0

    def get(self, ns_key: tuple[str, str], default: Entry | None = None) -> Entry | None:
        keys = self._by_ns.get(ns_key[0])
        return default if keys is None else keys.get(ns_key[1], default)

    def namespace(self, ns: str) -> Mapping[str, Entry]:
        """The READY entries of `ns` by key (read only): a batch's lookups without a tuple each."""
        return self._by_ns.get(ns, _NONE)

    def __contains__(self, ns_key: tuple[str, str]) -> bool:
        keys = self._by_ns.get(ns_key[0])
        return keys is not None and ns_key[1] in keys

    def __getitem__(self, ns_key: tuple[str, str]) -> Entry:
        return self._by_ns[ns_key[0]][ns_key[1]]

    def __setitem__(self, ns_key: tuple[str, str], entry: Entry) -> None:
        ns, key = ns_key
        keys = self._by_ns.get(ns)
        if keys is None:
            keys = self._by_ns[ns] = {}
        if key not in keys:
            self._len += 1
        keys[key] = entry

    def __delitem__(self, ns_key: tuple[str, str]) -> None:
        ns, key = ns_key
        keys = self._by_ns[ns]
        del keys[key]
        self._len -= 1
        if not keys:  # namespaces are client-chosen: an emptied one must not stay behind
            del self._by_ns[ns]

    def __len__(self) -> int:
        return self._len

    def values(self) -> Iterator[Entry]:
        for keys in self._by_ns.values():
            yield from keys.values()

    def items(self) -> Iterator[tuple[tuple[str, str], Entry]]:
        for ns, keys in self._by_ns.items():
            for key, entry in keys.items():
                yield (ns, key), entry
