"""Gets parked on keys not yet published: woken the moment a key is committed, expired after
their wait, dropped with their session. Mixed into Store (store.acquire parks them)."""
from __future__ import annotations

from ...errors import Code
from ...protocol import Failure
from .entries import Waiter
from .state import RegistryState


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
            # Keys that were present when the request parked may have gone since: keep waiting
            # (one that went to disk comes back again; without a wait, only such keys are waited for).
            gone = {k for k in waiter.keys if (waiter.ns, k) not in self.index}
            disk = self.disk
            if not waiter.patient:
                gone = {k for k in gone if k not in waiter.failures and disk is not None and disk.holds(waiter.ns, k)}
            if gone:
                waiter.missing = gone
                for k in gone:
                    self.waiters.setdefault((waiter.ns, k), set()).add(waiter)
                    if disk is not None:
                        disk.promote(waiter.ns, k)
            else:
                self._complete_waiter(waiter)


    def _complete_waiter(self, waiter: Waiter) -> None:
        self._drop_waiter(waiter)
        results = self._lease_all(waiter.session, waiter.ns, waiter.keys)
        if waiter.failures:  # a key whose promotion failed says why, not just "not found"
            results = [waiter.failures.get(k, r) if isinstance(r, Failure) else r for k, r in zip(waiter.keys, results)]
        waiter.on_done(results)


    def promotion_failed(self, ns: str, key: str, failure: Failure) -> None:
        """The disk tier could not bring `key` back: requests that waited only for that answer now."""
        parked = self.waiters.get((ns, key))
        if not parked:
            return
        for waiter in list(parked):
            waiter.failures[key] = failure
            if waiter.patient:
                continue  # it waits for a producer too
            waiter.missing.discard(key)
            parked.discard(waiter)
            if not waiter.missing:
                self._complete_waiter(waiter)
        if not parked:
            self.waiters.pop((ns, key), None)


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
