"""What a request must satisfy before the store acts on it: `[limits]` (the config's own section,
ecd/config.py: the one definition of the store's limits) applied to batches, keys, items and a
client's leases. A part the Store owns (store.checks); a refused item is a Failure in its slot, a
refused request a RequestError."""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

from ...errors import Code
from ...protocol import DTYPE_ITEMSIZE, AllocItem, Failure, expected_nbytes
from .entries import RequestError, Session

if TYPE_CHECKING:  # pragma: no cover
    from .state import RecordSet


class RequestChecks:
    def __init__(self, records: "RecordSet") -> None:
        self.r = records

    def batch(self, n: int) -> None:
        limit = self.r.limits.max_batch
        if n > limit:
            raise RequestError(Code.LIMIT, f"batch of {n} items exceeds limits.max_batch={limit}")

    def key(self, ns: str, key: str) -> Failure | None:
        limit = self.r.limits.max_key_bytes
        if len(key) == 0:
            return Failure(Code.INVALID, "empty key")
        # UTF-8 takes at most 4 bytes a character: a name this short needs no encoding to measure
        # (one encode per item was a tenth of a batched Alloc's checks)
        if 4 * len(key) > limit and (len(key) > limit or len(key.encode()) > limit):
            return Failure(Code.LIMIT, f"key of {len(key.encode())} bytes exceeds limits.max_key_bytes={limit}")
        if 4 * len(ns) > limit and (len(ns) > limit or len(ns.encode()) > limit):
            return Failure(Code.LIMIT, f"namespace longer than limits.max_key_bytes={limit}")
        return None

    def item(self, ns: str, item: AllocItem, pools: tuple[int, ...]) -> Failure | None:
        """An item to be written into `pools`: its key, dtype, shape and size."""
        failure = self.key(ns, item.key)
        if failure is not None:
            return failure
        if item.dtype not in DTYPE_ITEMSIZE:
            return Failure(Code.INVALID, f"unknown dtype {item.dtype!r}")
        max_ndim = self.r.limits.max_ndim
        if len(item.shape) > max_ndim:
            return Failure(Code.LIMIT, f"{len(item.shape)} dimensions exceed limits.max_ndim={max_ndim}")
        want = expected_nbytes(item.dtype, item.shape)
        if want != item.nbytes:
            return Failure(Code.INVALID, f"nbytes={item.nbytes} but shape {list(item.shape)} of "
                                         f"{item.dtype} needs {want}")
        too_large = self.r.host.too_large(item.nbytes, pools)
        if too_large:
            return Failure(Code.INVALID, too_large)
        return None

    def get(self, session: Session, ns: str, keys: list[str]) -> None:
        """A get (store.acquire): its batch, every key, and the read leases it would add."""
        self.batch(len(keys))
        for key in keys:
            failure = self.key(ns, key)
            if failure is not None:
                raise RequestError(cast(Code, failure.code), failure.message)  # key() gives Code values
        limit = self.r.limits.max_leases_per_client
        if len(session.leases) + len(keys) > limit:
            raise RequestError(Code.LIMIT, f"client holds {len(session.leases)} read leases; "
                                           f"limits.max_leases_per_client={limit}")

    def lookup(self, session: Session, keys: list[str], pin_s: float) -> None:
        """An exists (store.exists): its batch, and the pins it would add."""
        self.batch(len(keys))
        limit = self.r.limits.max_pins_per_client
        if pin_s > 0 and len(session.pins) + len(keys) > limit:
            raise RequestError(Code.LIMIT, f"client holds {len(session.pins)} pins; "
                                           f"limits.max_pins_per_client={limit}")
