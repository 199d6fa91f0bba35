"""Gets parked on keys not yet published: woken the moment a key is committed, expired after
their wait, dropped with their session. Mixed into Store (store.acquire parks them)."""
from __future__ import annotations

from ..errors import Code
from ..protocol import Failure
from .entries import Waiter
from .registry import RegistryState


class Waiting(RegistryState):
    @property
    def max_parked_keys(self) -> int:
        """Keys one client may have parked (waiting) at once, over all its parked requests."""
        return max(self.limits.max_batch, self.limits.max_waiters_per_client)


    def _wake_waiters(self, ns: str, key: str) -> None:
        parked = self.waiters.pop((ns, key), None)
        if not parked:
            return
        for waiter in parked:
            waiter.missing.discard(key)
            if waiter.missing:
                continue
            # Keys that were present when the request parked may have gone since: keep waiting.
            gone = {k for k in waiter.keys if (waiter.ns, k) not in self.index}
            if gone:
                waiter.missing = gone
                for k in gone:
                    self.waiters.setdefault((waiter.ns, k), set()).add(waiter)
            else:
                self._complete_waiter(waiter)


    def _complete_waiter(self, waiter: Waiter) -> None:
        self._drop_waiter(waiter)
        waiter.on_done(self._lease_all(waiter.session, waiter.ns, waiter.keys))


    def _expire_waiter(self, waiter: Waiter) -> None:
        waiter.timer = None
        if waiter in waiter.session.waiters:
            self._complete_waiter(waiter)


    def _drop_waiter(self, waiter: Waiter) -> None:
        if waiter in waiter.session.waiters:
            waiter.session.waiters.discard(waiter)
            waiter.session.parked_keys -= len(waiter.keys)
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None
        for key in waiter.missing:
            parked = self.waiters.get((waiter.ns, key))
            if parked is not None:
                parked.discard(waiter)
                if not parked:
                    del self.waiters[(waiter.ns, key)]


    def fail_waiters(self, code: Code, message: str) -> None:
        """Answer every parked request with a failure per key (used at shutdown)."""
        for session in list(self._sessions.values()):
            for waiter in list(session.waiters):
                self._drop_waiter(waiter)
                waiter.on_done([Failure(code, message) for _ in waiter.keys])
