"""Hostile clients, run as their own processes by test_neighbour_attacks.py.

    attacker.py unread ENDPOINT N          say hello, send N Keys(limit=1000) and never read
    attacker.py forged-pid ENDPOINT NS K.. hello claiming pid 1, read-lease keys K.. of NS, hold
    attacker.py sessions ENDPOINT N        open N sessions from this one process, print outcomes
    attacker.py raw-connections PATH N     N plain unix connections to the ipc socket, no ZMTP

Each prints one line when it has done its harm, then waits to be killed, holding its sockets
(each attack returns them: a socket garbage-collected would close and end the attack early).
"""
from __future__ import annotations

import resource
import socket
import sys
import time

import zmq

from ecd.protocol import PROTOCOL_VERSION, Acquire, Acquired, Error, Hello, Keys, Welcome, encoder, reply_decoder


def dealer(ctx: zmq.Context, endpoint: str, rcvhwm: int = 1000) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvhwm = rcvhwm
    sock.sndhwm = 0  # never block this side: everything it sends reaches the daemon
    sock.connect(endpoint)
    return sock


def hello(sock: zmq.Socket, pid: int) -> object:
    sock.send(encoder.encode(Hello(1, PROTOCOL_VERSION, pid, "attacker")))
    if not sock.poll(20_000):
        return None
    return reply_decoder().decode(sock.recv())


def unread(endpoint: str, n: int) -> None:
    ctx = zmq.Context()
    sock = dealer(ctx, endpoint, rcvhwm=1)  # replies back up into the daemon, not into this process
    assert isinstance(hello(sock, 0), Welcome)
    for i in range(n):
        sock.send(encoder.encode(Keys(i + 2, "", 1000)))
    print("sent", flush=True)
    return ctx, sock


def forged_pid(endpoint: str, ns: str, keys: list[str]) -> None:
    ctx = zmq.Context()
    sock = dealer(ctx, endpoint)
    assert isinstance(hello(sock, 1), Welcome)  # "I am init": a pid that never exits
    sock.send(encoder.encode(Acquire(2, ns, keys)))
    reply = reply_decoder().decode(sock.recv())
    assert isinstance(reply, Acquired) and all(not isinstance(r, Error) for r in reply.results), reply
    print("holding", flush=True)
    return ctx, sock


def sessions(endpoint: str, n: int) -> None:
    ctx = zmq.Context()
    welcomed = refused = silent = 0
    reasons = set()
    socks = []
    for _ in range(n):
        sock = dealer(ctx, endpoint)
        socks.append(sock)  # kept open: the sessions stay
        reply = hello(sock, 0)
        if isinstance(reply, Welcome):
            welcomed += 1
        elif isinstance(reply, Error):
            refused += 1
            reasons.add(reply.message)
        else:
            silent += 1
    print(f"welcomed={welcomed} refused={refused} silent={silent} reasons={sorted(reasons)!r}", flush=True)
    line = sys.stdin.readline()
    if line.strip() == "close":  # close every socket without Bye, the process stays alive
        for sock in socks:
            sock.close(0)
        print("closed", flush=True)
    return ctx, socks


def raw_connections(path: str, n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    conns, failed = [], 0
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            conns.append(s)
        except OSError:
            failed += 1
            s.close()
    print(f"connected={len(conns)} failed={failed}", flush=True)
    return conns  # held (the daemon may shed them: that is its defence)


def main() -> None:
    what, target, *rest = sys.argv[1:]
    if what == "unread":
        held = unread(target, int(rest[0]))
    elif what == "forged-pid":
        held = forged_pid(target, rest[0], rest[1:])
    elif what == "sessions":
        held = sessions(target, int(rest[0]))
    elif what == "raw-connections":
        held = raw_connections(target, int(rest[0]))
    else:
        raise SystemExit(f"unknown attack {what}")
    while held:
        time.sleep(60)


if __name__ == "__main__":
    main()
