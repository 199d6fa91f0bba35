"""The daemon's side of the holder (restart/holder.py): `HolderKeeper`, a PoolKeeper.

One connection to `<runtime_dir>/ecd.<node>.keeper/holder` for the daemon's whole run: the first
`take` or `keep` on it makes it the lease, and the holder holds the pool as long as it stays
open; when the daemon's process ends, however it ends, the kernel closes it and the holder's
`hold` clock starts. `close()` is that same ending said on purpose; `release()` a final stop.

keeper = "spawn" (and "auto" without systemd's store): when no holder answers, the daemon starts
one, detached (its own session, no descriptor of the daemon's, stdin on /dev/null, its output in
`<holder socket>.log`), and waits up to SPAWN_WAIT_S for its socket. keeper = "holder": someone else runs
`ecd hold`; the daemon waits up to EXTERNAL_WAIT_S for it and never starts one.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import msgspec

from .holder_wire import (HOLDER_WIRE_VERSION, HolderReply, HolderRequest, WireError, close_all, make_private_dir,
                          peer_ids, private_dir_problem, receive, reply_decoder, send, socket_path)
from .keeper import KeeperUnavailable
from ...fd_passing import FDS_PER_MESSAGE

log = logging.getLogger("ecd.restart")

SPAWN_WAIT_S = 5.0  # a holder we started must answer within this
EXTERNAL_WAIT_S = 10.0  # someone else's holder (a sidecar starting beside us) within this
BUSY_WAIT_S = 10.0  # a previous daemon's lease still open (it is exiting): retry this long
REPLY_TIMEOUT_S = 10.0
POLL_S = 0.02
MESSAGE_BYTES = 48 << 10  # names and paths per keep message, well under MAX_HEADER_BYTES


class HolderKeeper:
    kind = "holder"

    def __init__(self, node: str, runtime_dir: str, *, hold: float = 300.0, spawn: bool = True,
                 spawn_wait: float = SPAWN_WAIT_S, external_wait: float = EXTERNAL_WAIT_S,
                 busy_wait: float = BUSY_WAIT_S) -> None:
        self.node = node
        self.runtime_dir = runtime_dir
        self.path = socket_path(runtime_dir, node)
        self.hold = hold
        self.spawn = spawn
        self.spawn_wait = spawn_wait
        self.external_wait = external_wait
        self.busy_wait = busy_wait
        self.holder_pid = 0  # the holder's, from its replies
        self.spawned: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None

    # ---- PoolKeeper ----

    def take(self) -> dict[str, int]:
        if self.spawn and self._sock is None:
            self._sock = self._connect_once()
            if self._sock is None:
                return {}  # no holder, so no pool kept: one is started by keep(), once there is a pool
        replies, fds = self._leased_request(HolderRequest(version=HOLDER_WIRE_VERSION, op="take"), [])
        names = [name for reply in replies for name in reply.names]
        taken = dict(zip(names, fds))
        if len(taken) != len(fds):
            close_all(fds)
            raise KeeperUnavailable(f"the holder {self.path} sent {len(fds)} descriptor(s) under {len(taken)} name(s)")
        return taken

    def keep(self, fds: dict[str, int], unlink: Sequence[str] = ()) -> None:
        for attempt in (1, 2):
            try:
                self._leased_request(None, list(fds.items()), list(unlink))
                return
            except _Broken as exc:
                # The holder went away under our lease (killed, or it expired before we kept):
                # a keep carries the whole set, so sending it again to a new holder loses nothing.
                self._drop()
                if attempt == 2:
                    raise KeeperUnavailable(f"the holder {self.path} went away during keep: {exc}") from None

    def release(self) -> None:
        if self._sock is None:
            self._sock = self._connect_once()
            if self._sock is None:
                return  # no holder: nothing held
        try:
            self._exchange(HolderRequest(version=HOLDER_WIRE_VERSION, op="release"), [])
        except _Broken:
            pass  # it exited: what it held went with it
        except _Refused as exc:  # another daemon holds the pool now: not ours to let go
            raise KeeperUnavailable(f"the holder {self.path} refused to release: {exc.reply.error}") from None
        finally:
            self._drop()
            self._reap(wait=1.0)

    def close(self) -> None:
        self._drop()
        self._reap(wait=0.0)

    # ---- the connection ----

    def _leased_request(self, request: HolderRequest | None, items: list[tuple[str, int]],
                        unlink: Sequence[str] = ()) -> tuple[list[HolderReply], list[int]]:
        """A take (`request`) or a keep (`items`, `unlink`) on the lease, connecting first (and
        waiting out a previous daemon's lease that is still closing)."""
        busy_until = time.monotonic() + self.busy_wait
        while True:
            if self._sock is None:
                self._sock = self._connect()
            try:
                if request is not None:
                    return self._exchange(request, [])
                self._send_keep(items, unlink)
                return self._exchange(None, [])
            except _Refused as exc:
                if not exc.reply.busy or time.monotonic() >= busy_until:
                    raise KeeperUnavailable(f"the holder {self.path} refused: {exc.reply.error}") from None
                self._drop()  # another daemon's lease, still closing: ask again on a new connection
                time.sleep(0.1)
            except _Broken:
                if request is None:
                    raise
                self._drop()
                if time.monotonic() >= busy_until:
                    raise KeeperUnavailable(f"the holder {self.path} closed the connection") from None

    def _send_keep(self, items: list[tuple[str, int]], unlink: Sequence[str]) -> None:
        assert self._sock is not None
        paths = list(unlink)
        i = j = 0
        while True:
            budget = MESSAGE_BYTES
            names: list[str] = []
            fds: list[int] = []
            while i < len(items) and len(fds) < FDS_PER_MESSAGE and (not names or budget > len(items[i][0]) + 8):
                names.append(items[i][0])
                fds.append(items[i][1])
                budget -= len(items[i][0]) + 8
                i += 1
            chunk: list[str] = []
            while j < len(paths) and (not (names or chunk) or budget > len(paths[j]) + 8):
                chunk.append(paths[j])
                budget -= len(paths[j]) + 8
                j += 1
            last = i == len(items) and j == len(paths)
            try:
                send(self._sock, HolderRequest(version=HOLDER_WIRE_VERSION, op="keep", names=names, unlink=chunk,
                                               last=last), fds)
            except WireError as exc:
                raise _Broken(str(exc)) from None
            if last:
                return

    def _exchange(self, request: HolderRequest | None, sent_fds: list[int]) -> tuple[list[HolderReply], list[int]]:
        """Send `request` (None: already sent) and collect the reply's batches and descriptors."""
        sock = self._sock
        assert sock is not None
        if request is not None:
            try:
                send(sock, request, sent_fds)
            except WireError as exc:
                raise _Broken(str(exc)) from None
        replies: list[HolderReply] = []
        fds: list[int] = []
        try:
            while True:
                try:
                    data, got = receive(sock)
                except (OSError, WireError) as exc:
                    raise _Broken(getattr(exc, "strerror", None) or str(exc) or "timed out") from None
                fds.extend(got)
                if not data:
                    raise _Broken("the holder closed the connection")
                try:
                    reply = reply_decoder.decode(data)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise KeeperUnavailable(f"a malformed reply from the holder {self.path}: {exc}") from None
                self.holder_pid = reply.pid or self.holder_pid
                if reply.error:
                    raise _Refused(reply)
                if reply.version != HOLDER_WIRE_VERSION or len(reply.names) != len(got):
                    raise KeeperUnavailable(f"the holder {self.path} sent version {reply.version} with {len(got)} "
                                            f"descriptor(s) for {len(reply.names)} name(s)")
                replies.append(reply)
                if reply.last:
                    return replies, fds
        except BaseException:
            close_all(fds)
            raise

    def _connect_once(self) -> socket.socket | None:
        problem = private_dir_problem(os.path.dirname(self.path))
        if problem == "missing":
            return None  # no holder yet
        if problem:
            raise KeeperUnavailable(f"the holder's directory is not private ({problem}): no pool is taken from a "
                                    "socket there or handed to it")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(REPLY_TIMEOUT_S)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            return None
        # Who listens there, as the kernel recorded it at listen(): anyone who may create names in
        # the runtime directory could have bound a socket of their own under the holder's name, to
        # hand this daemon a forged pool and take its real one (issue 40, attack 1). Only a holder
        # of this daemon's uid or root is one; the holder checks the daemon the same way.
        pid, uid, _gid = peer_ids(sock)
        if uid not in (os.geteuid(), 0):
            sock.close()
            raise KeeperUnavailable(f"the holder socket {self.path} is served by uid {uid} (pid {pid}), neither this "
                                    f"daemon's uid ({os.geteuid()}) nor root: no pool is taken from it or handed to it")
        return sock

    def _connect(self) -> socket.socket:
        sock = self._connect_once()
        if sock is not None:
            return sock
        if self.spawn:
            self._start_holder()
        wait = self.spawn_wait if self.spawn else self.external_wait
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            sock = self._connect_once()
            if sock is not None:
                return sock
            if self.spawned is not None and self.spawned.poll() not in (None, 1):  # 1: another holder won the race
                raise KeeperUnavailable(f"the holder this daemon started for node {self.node!r} exited with "
                                        f"status {self.spawned.returncode} (its reason is in the log above)")
            time.sleep(POLL_S)
        if self.spawn:
            raise KeeperUnavailable(f"the holder this daemon started did not answer on {self.path} within {wait:g} s")
        raise KeeperUnavailable(f"no holder answers on {self.path} within {wait:g} s: run `ecd hold --node "
                                f"{self.node} --runtime-dir {self.runtime_dir}` (a sidecar, a unit of its own) "
                                f'or set [restart] keeper = "spawn"')

    def _start_holder(self) -> None:
        env = dict(os.environ)
        # the holder imports ecd from where this daemon did, whatever its working directory was
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        command = [sys.executable, "-m", "ecd.daemon.restart.holder", "--node", self.node,
                   "--runtime-dir", self.runtime_dir, "--hold", repr(float(self.hold)), "--spawned"]
        # Its log goes to a file beside its socket: it outlives the daemon, and holding the daemon's
        # stderr (a pipe someone reads to its end) would keep that reader waiting for it.
        log_path = self.path + ".log"
        problem = make_private_dir(os.path.dirname(self.path))
        if problem:
            raise KeeperUnavailable(f"cannot start a holder for node {self.node!r}: {problem}")
        try:
            with open(log_path, "ab") as holder_log:
                os.chmod(log_path, 0o600)
                self.spawned = subprocess.Popen(command, start_new_session=True, close_fds=True, cwd="/", env=env,
                                                stdin=subprocess.DEVNULL, stdout=holder_log, stderr=holder_log)
        except OSError as exc:
            raise KeeperUnavailable(f"cannot start a holder for node {self.node!r}: {exc.strerror or exc}") from None
        log.info("started a holder (pid %d) for node %s on %s (its log: %s): it keeps the host pool for %g s after "
                 "this daemon ends", self.spawned.pid, self.node, self.path, log_path, self.hold)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _reap(self, wait: float) -> None:
        """Collect a holder we started once it exited (no zombie while the daemon runs on)."""
        if self.spawned is not None:
            try:
                self.spawned.wait(wait) if wait else self.spawned.poll()
            except subprocess.TimeoutExpired:
                pass
            if self.spawned.returncode is not None:
                self.spawned = None


class _Refused(Exception):
    def __init__(self, reply: HolderReply) -> None:
        super().__init__(reply.error)
        self.reply = reply


class _Broken(Exception):
    """The connection failed under a request: the holder exited or was killed."""
