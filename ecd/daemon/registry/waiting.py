"""Gets parked on keys not yet published: woken the moment a key is committed, expired after
their wait, dropped with their session. A part the Store owns (store.waiting; store.acquire
parks them); the parked requests by key are the store's `waiters` record."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Collection

from ...errors import Code
from ...protocol import Failure, Location
from .entries import RequestError, Session, Waiter

if TYPE_CHECKING:  # pragma: no cover
    from .state import RecordSet

PROMOTE_WAIT_S = 30.0  # the longest a get waits for its keys to come back from the lower tier


class Waiting:
    def __init__(self, records: "RecordSet") -> None:
        self.r = records

    @property
    def max_parked_keys(self) -> int:
        """Keys one client may have parked (waiting) at once, over all its parked requests."""
        return max(self.r.limits.max_batch, self.r.limits.max_waiters_per_client)

    def park(self, session: Session, ns: str, keys: list[str], missing: set[str], promotable: Collection[str],
             wait_s: float, on_done: Callable[[list[Location | Failure]], None]) -> None:
        """Park a get (store.acquire) until its `missing` keys are READY or `wait_s` passes
        (RequestError LIMIT when its client may park no more). `promotable`: missing keys the
        lower tier holds, brought back now; a get with no wait waits for those only, and at
        least PROMOTE_WAIT_S."""
        r = self.r
        limits = r.limits
        if len(session.waiters) >= limits.max_waiters_per_client:
            raise RequestError(Code.LIMIT, f"client has {len(session.waiters)} parked requests; "
                                           f"limits.max_waiters_per_client={limits.max_waiters_per_client}")
        # A parked key costs the daemon a few hundred bytes: without a bound on keys, the
        # request limit times max_batch would let one client park tens of GB.
        max_keys = self.max_parked_keys
        if session.parked_keys + len(keys) > max_keys:
            raise RequestError(Code.LIMIT, f"client has {session.parked_keys} keys parked in "
                                           f"{len(session.waiters)} requests; {len(keys)} more would pass "
                                           f"{max_keys}, the most one client may wait for (the larger of "
                                           f"limits.max_batch and limits.max_waiters_per_client)")
        patient = wait_s > 0
        waiter = Waiter(session, ns, keys, missing if patient else set(promotable), on_done, patient=patient)
        for key in waiter.missing:
            r.waiters.setdefault((ns, key), set()).add(waiter)
        session.waiters.add(waiter)
        session.parked_keys += len(keys)
        wait = min(wait_s, r.leases.max_wait)
        if promotable:
            wait = max(wait, PROMOTE_WAIT_S)
            for key in promotable:
                r.lower_tier.promote(ns, key)
        waiter.timer = r.scheduler.call_later(wait, lambda: self.expire(waiter))

    def wake(self, ns: str, key: str) -> None:
        """`key` was published: requests that waited for it complete, or wait on for keys gone since."""
        r = self.r
        parked = r.waiters.pop((ns, key), None)
        if not parked:
            return
        for waiter in parked:
            waiter.missing.discard(key)
            if waiter.missing:
                continue
            # Keys that were present when the request parked may have gone since: keep waiting
            # (one that went to disk comes back again; without a wait, only such keys are waited for).
            gone = {k for k in waiter.keys if (waiter.ns, k) not in r.index}
            lower = r.lower_tier
            if not waiter.patient:
                gone = {k for k in gone if k not in waiter.failures and lower.holds(waiter.ns, k)}
            if gone:
                waiter.missing = gone
                for k in gone:
                    r.waiters.setdefault((waiter.ns, k), set()).add(waiter)
                    lower.promote(waiter.ns, k)
            else:
                self._complete(waiter)

    def _complete(self, waiter: Waiter) -> None:
        self.drop(waiter)
        results = self.r.lease_all(waiter.session, waiter.ns, waiter.keys)
        if waiter.failures:  # a key whose promotion failed says why, not just "not found"
            results = [waiter.failures.get(k, r) if isinstance(r, Failure) else r for k, r in zip(waiter.keys, results)]
        waiter.on_done(results)


    def promotion_failed(self, ns: str, key: str, failure: Failure) -> None:
        """The lower tier could not bring `key` back: requests that waited only for that answer now."""
        parked = self.r.waiters.get((ns, key))
        if not parked:
            return
        for waiter in list(parked):
            waiter.failures[key] = failure
            if waiter.patient:
                continue  # it waits for a producer too
            waiter.missing.discard(key)
            parked.discard(waiter)
            if not waiter.missing:
                self._complete(waiter)
        if not parked:
            self.r.waiters.pop((ns, key), None)

    def expire(self, waiter: Waiter) -> None:
        """Its wait is over: answered with what there is."""
        waiter.timer = None
        if waiter in waiter.session.waiters:
            self._complete(waiter)

    def drop(self, waiter: Waiter) -> None:
        """Unpark a request without answering it (its session went, or it is answered now)."""
        if waiter in waiter.session.waiters:
            waiter.session.waiters.discard(waiter)
            waiter.session.parked_keys -= len(waiter.keys)
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None
        waiters = self.r.waiters
        for key in waiter.missing:
            parked = waiters.get((waiter.ns, key))
            if parked is not None:
                parked.discard(waiter)
                if not parked:
                    del waiters[(waiter.ns, key)]

    def fail_all(self, code: Code, message: str) -> None:
        """Answer every parked request with a failure per key (used at shutdown)."""
        for session in list(self.r.each_session()):
            for waiter in list(session.waiters):
                self.drop(waiter)
                waiter.on_done([Failure(code, message) for _ in waiter.keys])
