"""A hostile peer, run as its own process by test_peer_flood.py: it speaks the peer protocol on a
raw DEALER (no PeerLink, none of the puller's manners).

    peer_attacker.py lookups ENDPOINT NS MESSAGES DISTINCT REPEAT READ [TTL_S]

says peer_hello, then sends MESSAGES lookups, each naming the keys flood_key(0..DISTINCT-1),
the list repeated REPEAT times. READ 0: it never reads a reply (they back up into the owner);
and sends a peer_ping after each, so its session stays alive (a puller's pings would);
READ 1: it reads each and prints one line per reply ("leased N", "error CODE MESSAGE", "none");
READ 2: the same, but it sends all its lookups first and then reads the replies (pipelined).
It prints "hello" once welcomed and "sent N" once its sends are done (a send the owner does not
take within SEND_TIMEOUT_MS ends them), then waits to be killed, holding its socket and pinging
every second (its session, and any leases it holds, stay until their TTL_S, default 60).
"""
from __future__ import annotations

import sys
import time

import zmq

from ecd.peer_protocol import (PEER_PROTOCOL_VERSION, Leased, Lookup, PeerError, PeerHello, PeerPing, PeerWelcome,
                               encoder, peer_reply_decoder)

SEND_TIMEOUT_MS = 20_000
KEY_BYTES = 1000


def flood_key(i: int) -> str:
    """The i-th key of the flood: 1000 bytes, as in the issue (the test puts them)."""
    return f"flood-{i:06d}-".ljust(KEY_BYTES, "x")


def lookups(endpoint: str, ns: str, messages: int, distinct: int, repeat: int, read: bool, ttl_s: float,
            pipelined: bool = False):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvhwm = 1  # unread replies back up into the owner, not into this process
    sock.sndhwm = 2  # nor do our lookups pile up here: the owner takes them at its pace
    sock.sndtimeo = SEND_TIMEOUT_MS
    sock.connect(endpoint)
    decoder = peer_reply_decoder()
    sock.send(encoder.encode(PeerHello(1, PEER_PROTOCOL_VERSION, "attacker", 0)))
    assert sock.poll(20_000), "no welcome"
    welcome = decoder.decode(sock.recv())
    assert isinstance(welcome, PeerWelcome), welcome
    print("hello", flush=True)
    keys = [flood_key(i) for i in range(distinct)] * repeat
    payload = encoder.encode(Lookup(2, ns, keys, ttl_s))  # one message, sent again and again
    sent = 0
    for _ in range(messages):
        try:
            sock.send(payload)
        except zmq.Again:  # the owner stopped taking our messages (or cut us off)
            break
        sent += 1
        if not read:  # keep the session alive (as a puller's pings do) without reading a thing
            try:
                sock.send(encoder.encode(PeerPing(3)))
            except zmq.Again:
                break
        if read and not pipelined:
            print_reply(sock, decoder)
    if pipelined:
        for _ in range(sent):
            print_reply(sock, decoder)
    print(f"sent {sent}", flush=True)
    return ctx, sock


def print_reply(sock: zmq.Socket, decoder) -> None:
    if not sock.poll(30_000):
        print("none", flush=True)
        return
    reply = decoder.decode(sock.recv())
    if isinstance(reply, Leased):
        print(f"leased {sum(o is not None for o in reply.offers)}", flush=True)
    elif isinstance(reply, PeerError):
        print(f"error {reply.code} {reply.message}", flush=True)
    else:
        print(f"other {type(reply).__name__}", flush=True)


def hold(sock: zmq.Socket, read: bool) -> None:
    while True:
        time.sleep(1.0)
        try:
            sock.send(encoder.encode(PeerPing(4)), zmq.NOBLOCK)
        except zmq.Again:
            pass
        while read and sock.poll(0):
            sock.recv()


def main() -> None:
    what, endpoint, *rest = sys.argv[1:]
    if what != "lookups":
        raise SystemExit(f"unknown attack {what}")
    ns, messages, distinct, repeat, read, *ttl = rest
    _ctx, sock = lookups(endpoint, ns, int(messages), int(distinct), int(repeat), read != "0",
                         float(ttl[0]) if ttl else 60.0, pipelined=read == "2")
    hold(sock, read != "0")


if __name__ == "__main__":
    main()
