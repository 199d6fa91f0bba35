"""The submission areas of a pool cut into tenants' parts: one SubmissionArea (consumer.py) in the
tail of each part's first segment (restart/adopt.py's pool_layout) — the default tenant's in
segment 0, each sized tenant's in its own segments — each with its own doorbell, so a sized
tenant's clients post records into their own segments and ring a bell no other tenant holds.
Leases are one Leasing for all: a session's are its own, whichever area it posts in."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...protocol import Failure
from ..registry.entries import Session
from .leases import TIER_HOST

if TYPE_CHECKING:  # pragma: no cover
    import asyncio

    from .consumer import SubmissionArea


class SubmissionAreas:
    def __init__(self, by_tenant: "dict[str, SubmissionArea]") -> None:
        """`by_tenant`: each part's area ("": the default tenant's, which every unsized tenant's
        clients share)."""
        self.by_tenant = by_tenant
        self.default = by_tenant[""]

    def area_of(self, session: Session) -> "SubmissionArea":
        return self.by_tenant.get(session.tenant, self.default)

    def assign(self, session: Session) -> list[int]:
        """[pool, page offset, records, area offset] of the session's page in its tenant's area."""
        return self.area_of(session).assign(session)

    def close(self, session: Session) -> None:
        self.area_of(session).close(session)

    def grant(self, session: Session, ns: str, nbytes: int, tier: int = TIER_HOST) -> Failure | None:
        return self.area_of(session).grant(session, ns, nbytes, tier)

    def drain(self) -> int:
        return sum(area.drain() for area in self.by_tenant.values())

    def start(self, loop: "asyncio.AbstractEventLoop") -> None:
        for area in self.by_tenant.values():
            area.start(loop)

    def stop(self) -> None:
        for area in self.by_tenant.values():
            area.stop()

    def totals(self) -> tuple[int, int, int]:
        """(put leases, bytes they hold not yet carved, pages in use): for /metrics."""
        leases, leased_bytes, _ = self.default.totals()  # (one Leasing for all)
        return leases, leased_bytes, sum(area.totals()[2] for area in self.by_tenant.values())
