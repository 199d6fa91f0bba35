"""A process playing the daemon's side of a pool keeper (test_holder.py, test_fdstore.py).

    keeper_actor.py [--uid UID] COMMAND ARGS...   (prints one JSON line per step)

    keep-holder NODE DIR SEED SIZE [spawn|holder] [NAMED_PATH]
        a sealed memfd "pool.0" of SIZE bytes derived from SEED (+ a named /dev/shm file
        NAMED_PATH of SEED+1 as "pool.1", given to unlink), kept with a HolderKeeper; prints
        {"kept": ..., "holder_pid": ...}, then waits on stdin: "close" (HolderKeeper.close),
        "release", or EOF (exit without a word, as a killed daemon)
    take-holder NODE DIR [BUSY_WAIT]
        takes, prints {"taken": {name: {"size", "sha", "seals"}}} (or {"error": ...}), keeps them
        again and waits on stdin as above
    keep-systemd SEED SIZE          ($NOTIFY_SOCKET, $FDSTORE) stores "pool.0" and "journal"; exits
    take-systemd                    takes as systemd passed them; prints what it got and the env
    raw-connect DIR NODE            (as --uid) connect to the holder socket and ask `take`:
                                    prints {"connect": "ok"|errno name, "reply": error text}
--uid: started as root, it drops to that uid once its modules are imported.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import random
import socket
import sys
from pathlib import Path

from ecd.daemon.restart.fdstore import SystemdKeeper
from ecd.daemon.restart.holder_client import HolderKeeper
from ecd.daemon.restart.holder_wire import (HOLDER_WIRE_VERSION, HolderRequest, WireError, receive, reply_decoder,
                                            send, socket_path)
from ecd.daemon.restart.keeper import KeeperUnavailable
from ecd.memory.memfd import F_GET_SEALS, MemfdFile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: privileges.py
from privileges import drop_if_asked  # noqa: E402


def pattern(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def describe(fd: int) -> dict:
    size = os.fstat(fd).st_size
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
        sha = hashlib.sha256(m).hexdigest()
    try:
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError:
        seals = -1
    return {"size": size, "sha": sha, "seals": seals}


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def wait_then(keeper) -> None:
    line = sys.stdin.readline().strip()
    if line == "close":
        keeper.close()
    elif line == "release":
        keeper.release()
    say(done=line or "eof")


def memfd(seed: int, size: int) -> MemfdFile:
    f = MemfdFile.create_sealed(f"ecd-test-{seed}", size)
    f.buf[:] = pattern(seed, size)
    return f


def main(argv: list[str]) -> None:
    argv = drop_if_asked(argv)
    command, args = argv[0], argv[1:]
    if command == "keep-holder":
        node, directory, seed, size = args[0], args[1], int(args[2]), int(args[3])
        spawn = len(args) < 5 or args[4] == "spawn"
        keeper = HolderKeeper(node, directory, hold=float(os.environ.get("TEST_HOLD", "30")), spawn=spawn)
        keeper.take()
        pool = memfd(seed, size)
        fds, unlink = {"pool.0": pool.fd}, []
        if len(args) > 5:
            fd = os.open(args[5], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, pattern(seed + 1, size))
            fds["pool.1"] = fd
            unlink.append(args[5])
        keeper.keep(fds, unlink)
        say(kept={name: describe(fd) for name, fd in fds.items()}, holder_pid=keeper.holder_pid)
        wait_then(keeper)
    elif command == "take-holder":
        keeper = HolderKeeper(args[0], args[1], spawn=False, external_wait=2.0,
                              busy_wait=float(args[2]) if len(args) > 2 else 10.0)
        try:
            taken = keeper.take()
        except KeeperUnavailable as exc:
            say(error=str(exc))
            return
        say(taken={name: describe(fd) for name, fd in taken.items()}, holder_pid=keeper.holder_pid)
        keeper.keep(taken)
        wait_then(keeper)
    elif command == "keep-systemd":
        keeper = SystemdKeeper()
        seed, size = int(args[0]), int(args[1])
        pool, journal = memfd(seed, size), memfd(seed + 1, 4096)
        try:
            keeper.keep({"pool.0": pool.fd, "journal": journal.fd})
        except KeeperUnavailable as exc:
            say(error=str(exc))
            return
        say(kept={"pool.0": describe(pool.fd), "journal": describe(journal.fd)})
    elif command == "take-systemd":
        keeper = SystemdKeeper()
        taken = keeper.take()
        cloexec = {name: bool(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC) for name, fd in taken.items()}
        say(taken={name: describe(fd) for name, fd in taken.items()}, fds=taken, cloexec=cloexec,
            env_left=sorted(k for k in os.environ if k.startswith("LISTEN_")), again=keeper.take())
    elif command == "raw-connect":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(5.0)
        try:
            sock.connect(socket_path(args[0], args[1]))
        except OSError as exc:
            say(connect=errno.errorcode.get(exc.errno or 0, str(exc)), uid=os.getuid())
            return
        try:
            send(sock, HolderRequest(version=HOLDER_WIRE_VERSION, op="take"))
        except WireError:
            pass  # refused at once and closed: the refusal waits to be read
        data, fds = receive(sock)
        say(connect="ok", uid=os.getuid(), fds=len(fds), reply=reply_decoder.decode(data).error if data else "")
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main(sys.argv[1:])
