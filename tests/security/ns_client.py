"""A client process as a container runs it: started by test_pid_namespaces.py and test_allowed_uids.py,
often under `unshare --pid --fork` (its own pid namespace, where it is pid 1: it then acts as the
container's init, forks the engine and waits).

    ns_client.py hold ENDPOINT NS KEY [fork]
        hello, read-lease and pin KEY of NS, start a 1 MiB write it never commits, print {"host_pid", "ns_pid", "pid_ns"} and hold them
        until killed; with `fork` the engine forks a child that keeps the connection open (and
        prints its host pid as "child_host_pid") and does nothing else
    ns_client.py connect ENDPOINT [--uid UID --gid GID --groups G,G..] [--put 1]
        as root, drop to that uid, gid and supplementary groups (after the imports: this Python's
        files may sit where that user cannot read), then say hello with ecd's ControlClient;
        print {"uid", "gid", "groups", "outcome": welcome | ErrorClassName, "message"}; with --put also
        put and get 1 MiB with ecd's Client: {"put_get": equal, "sealed", "local"}

host_pid comes from /proc/self/status's NSpid (this process's pid in each namespace from the
host's down): run without --mount-proc so /proc is the host's.
"""
from __future__ import annotations

import encodings.idna  # noqa: F401 - looked up lazily by socket code; after a drop it may not be readable
import json
import os
import sys
import time

import zmq
import zmq.utils.monitor  # noqa: F401 - the client imports it lazily (handshake checks); after a drop it may not be readable

from ecd.client.control import ControlClient
from ecd.errors import EcdError
from ecd.protocol import (PROTOCOL_VERSION, Acquire, Acquired, Alloc, Allocated, AllocItem, Exists, Failure, Flags,
                          Hello, Welcome, encoder, reply_decoder)


def host_pid() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[1])
    return os.getpid()


def as_init() -> None:
    """Pid 1 of a new pid namespace: fork the engine, reap children, exit with the engine's status
    (its death kills the namespace's other processes, as a container's init's does)."""
    engine = os.fork()
    if engine == 0:
        return
    status = 0
    while True:
        try:
            pid, st = os.wait()
        except ChildProcessError:
            os._exit(status)
        if pid == engine:
            status = os.waitstatus_to_exitcode(st)


def hold(endpoint: str, ns: str, key: str, fork: bool) -> None:
    sock = zmq.Context().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    decoder = reply_decoder()

    def ask(message):
        sock.send(encoder.encode(message))
        assert sock.poll(20_000), f"no answer to {message!r}"
        return decoder.decode(sock.recv())

    welcome = ask(Hello(1, PROTOCOL_VERSION, os.getpid(), "ns-holder", os.stat("/proc/self/ns/pid").st_ino))
    assert isinstance(welcome, Welcome), welcome
    acquired = ask(Acquire(2, ns, [key]))
    assert isinstance(acquired, Acquired) and all(not isinstance(r, Failure) for r in acquired.results), acquired
    pinned = ask(Exists(3, ns, [key], 600.0))
    assert isinstance(pinned, Flags) and pinned.values == [True], pinned
    # and 1 MiB of the pool in a write it never commits
    writing = ask(Alloc(4, ns, [AllocItem(f"{key}.w", "uint8", [1 << 20], 1 << 20)]))
    assert isinstance(writing, Allocated) and not isinstance(writing.results[0], Failure), writing
    report = {"host_pid": host_pid(), "ns_pid": os.getpid(), "pid_ns": os.stat("/proc/self/ns/pid").st_ino,
              "heartbeat_s": welcome.heartbeat_s}
    if fork:
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # keeps the inherited connection open, touches nothing of zmq
            os.write(write, str(host_pid()).encode())
            while True:
                time.sleep(60)
        report["child_host_pid"] = int(os.read(read, 32))
    print(json.dumps(report), flush=True)
    while True:
        time.sleep(60)


def connect(endpoint: str, uid: int | None, gid: int | None, groups: list[int], put: bool = False) -> None:
    if put:
        from ecd import Client  # (imported before the drop: torch's files may not be that user's to read)
        import torch
    if uid is not None:
        os.setgroups(groups)
        os.setgid(gid if gid is not None else uid)
        os.setuid(uid)
    out: dict = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups())}
    try:
        with ControlClient(endpoint, timeout=30.0) as client:
            client.ping()
        out.update(outcome="welcome", message="")
        if put:  # a put and a get through the pool as this uid maps it (the fd socket's memfds)
            with Client(endpoint, timeout=30.0) as c:
                sent = torch.randn(1 << 18)
                c.put(f"from-{os.getuid()}", sent)
                got = c.get(f"from-{os.getuid()}")
                out.update(put_get=bool(torch.equal(sent, got)), sealed=c.mapping.sealed, local=c.mapping.local)
    except EcdError as exc:
        out.update(outcome=type(exc).__name__, message=str(exc))
    print(json.dumps(out), flush=True)


def main() -> None:
    what, endpoint, *rest = sys.argv[1:]
    if what == "hold":
        if os.getpid() == 1:
            as_init()
        hold(endpoint, rest[0], rest[1], rest[2:] == ["fork"])
    elif what == "connect":
        opts = dict(zip(rest[::2], rest[1::2]))
        uid = int(opts["--uid"]) if "--uid" in opts else None
        gid = int(opts["--gid"]) if "--gid" in opts else None
        groups = [int(g) for g in opts.get("--groups", "").split(",") if g]
        connect(endpoint, uid, gid, groups, put="--put" in rest)
    else:
        raise SystemExit(f"unknown command {what}")


if __name__ == "__main__":
    main()
