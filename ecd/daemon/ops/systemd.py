"""sd_notify, spoken directly (no libsystemd): READY, STATUS, WATCHDOG, STOPPING datagrams."""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("ecd.systemd")


class Notifier:
    """Sends to $NOTIFY_SOCKET when systemd (or a test) set it; does nothing otherwise."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None
        if self._address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        # systemd asks for a ping at least every WATCHDOG_USEC; ping at half of it
        mine = not pid or pid == str(os.getpid())
        self.watchdog_interval = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and mine else None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *fields: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto("\n".join(fields).encode(), self._address)
        except OSError as exc:  # systemd gone or socket full: never fatal to the daemon
            log.debug("sd_notify failed: %s", exc)

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def stopping(self, status: str) -> None:
        self.notify("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
