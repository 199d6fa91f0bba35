"""Test support: the seams of a client that tests spy on or inject into, named in one place.

Not for production use. Tests reach a client's inside only through these functions (or the
client's public read-only properties: welcome, session_id, heartbeating, mapping,
location_cache), never through its private attributes, so the client can change inside without
breaking them.

- `intercept_round_trips`: see (or stall, or fail) each request a client, or every client of a
  class, sends and waits for, with the reply it got;
- `acquire`: take read leases at the wire level, as get() does before it copies, and release them;
- `replace_location_cache`: give a client a location cache of another size;
- `submission_page`: the client's submission page (ecd.writes.producer.Submissions), to place
  and post records by hand as a broken or hostile producer would;
- `put_into_arena`: the put route a CUDA tensor takes once its tier is chosen (an arena), for
  tensors of a machine without a GPU (tests/fake_gpu_plane.py copies them "on the device").
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

from ..protocol import Failure, Location
from .control import ControlClient
from .location_cache import LocationCache

# interceptor(request, send) -> reply, where send(request) makes the real round trip
Interceptor = Callable[[Any, Callable[[Any], Any]], Any]


@contextlib.contextmanager
def intercept_round_trips(target: ControlClient | type[ControlClient], interceptor: Interceptor) -> Iterator[None]:
    """Inside the block, every round trip `target` makes (a client, or every client of that
    class) goes through `interceptor(request, send)`: `send(request)` makes the real round trip
    (with the request's own wait) and returns the reply, and what the interceptor returns is the
    reply the client sees. It runs where the round trip runs: under the client's lock, after the
    request was numbered. Fire-and-forget messages (Release, Abort of a reservation, Report,
    Ping of the heartbeat, send_pin, send_unpin) are not round trips and do not pass through it."""
    if isinstance(target, type):
        real_method = target._call_locked

        def patched_method(self, request, wait_s: float = 0.0):
            return interceptor(request, lambda message: real_method(self, message, wait_s))

        target._call_locked = patched_method  # type: ignore[method-assign]
        try:
            yield
        finally:
            target._call_locked = real_method  # type: ignore[method-assign]
        return
    real = target._call_locked
    before = vars(target).get("_call_locked")  # an interception around this one, or None

    def patched(request, wait_s: float = 0.0):
        return interceptor(request, lambda message: real(message, wait_s))

    target._call_locked = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        if before is None:
            del target._call_locked  # the class's method again
        else:
            target._call_locked = before  # type: ignore[method-assign]


def acquire(client, keys: list[str], timeout: float | None = None
            ) -> tuple[list[Location | Failure], Callable[[], None]]:
    """Read leases on `keys` as get() takes them before it copies: (the daemon's answer per key,
    a Location or a Failure; a function that releases the leases taken, fire-and-forget as get()
    does). A lease not released is held until the client's session ends."""
    client._settle_writes(list(keys))  # as get() does: this client's puts of them first
    results, session, mapping = client._acquire(list(keys), timeout)
    held = [r.generation for r in results if isinstance(r, Location)]
    return results, lambda: client._release(held, session, mapping.epoch)


def replace_location_cache(client, cache: LocationCache) -> None:
    """Give `client` this (empty) location cache instead of its own, e.g. a smaller one."""
    with client._lock:
        client._cache = cache


def submission_page(client):
    """The Submissions object of the client's current session (None: it has no page)."""
    return client._writes


def place_on_page(client, tensors: dict, sizes: list[int], dtypes: list[str], metas: dict | None = None,
                  tier: int = -1) -> list:
    """Place `tensors` on the client's submission page as its put route does (Placed each: where
    its bytes go, its sequence number), asking for a lease when none holds them; nothing copied
    or posted (a test writes the record itself)."""
    page = client._writes
    return page.place(client.namespace, functools.partial(client._puts.lease_space, client), tensors, sizes, dtypes,
                      metas, tier)


def put_into_arena(client, items: dict, arena: int, wait: bool = True, checksum: bool = False) -> None:
    """Put `items` into the CUDA arena of pool index `arena` as Client.put does for tensors on
    its device after choosing their tier: placed in the session's put leases of that arena (or
    allocated there), copied by the client's CUDA plane, committed."""
    client._puts.put(client, dict(items), client._verifies(checksum), arena, False, None, wait)
