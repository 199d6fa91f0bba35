"""A local user out to read another tenant's entries through the peer plane, run as its own process
(by test_peer_loopback.py, as user `nobody`: another uid, outside the daemon's group).

    peer_intruder.py [--uid UID] steal ENDPOINT NS KEY [SERVER_KEY]
        say peer_hello at a daemon's peer control ENDPOINT (as a CURVE client with a key pair of
        its own when the daemon's public SERVER_KEY is given, else in plaintext), look KEY up in
        NS and read its bytes from the data port the welcome names
    peer_intruder.py [--uid UID] guess HOST PORT
        present a made-up token at a data port

--uid: started as root, it drops to that uid (and its group, no supplementary groups) once its
modules are imported (this Python's own files may sit where that user cannot read) and before it
opens any socket. Each prints one JSON line, with the uid it ran as: how far it got ("hello": welcome / silent / error, "lookup": offer /
none / silent, "data": the bytes' hex when it read any; for guess "status" or "closed").
"""
from __future__ import annotations

import encodings.idna  # noqa: F401 - socket looks it up lazily; after the drop it may not be readable
import json
import os
import secrets
import socket
import struct
import sys
from pathlib import Path

import zmq

from ecd.peer_protocol import (PEER_PROTOCOL_VERSION, Leased, Lookup, PeerHello, PeerWelcome, encoder,
                               peer_reply_decoder)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: privileges.py
from privileges import drop_if_asked  # noqa: E402

REPLY_WAIT_MS = 3000
REQUEST_HEAD = struct.Struct("!4sI")  # ecd/transport/tcp.py's data wire
ITEM_HEAD = struct.Struct("!BQ")


def _ask(sock: zmq.Socket, message) -> object:
    sock.send(encoder.encode(message))
    if not sock.poll(REPLY_WAIT_MS):
        return None
    return peer_reply_decoder().decode(sock.recv())


def _read_entry(host: str, port: int, token: bytes) -> dict:
    with socket.create_connection((host, port), timeout=5) as conn:
        conn.settimeout(5)
        conn.sendall(REQUEST_HEAD.pack(b"ECD2", 1) + token)
        head = _recv(conn, ITEM_HEAD.size)
        if len(head) < ITEM_HEAD.size:
            return {"closed": True}
        status, nbytes = ITEM_HEAD.unpack(head)
        return {"status": status, "data": _recv(conn, nbytes).hex() if status == 0 else ""}


def _recv(conn: socket.socket, n: int) -> bytes:
    out = b""
    try:
        while len(out) < n:
            chunk = conn.recv(n - len(out))
            if not chunk:
                break
            out += chunk
    except OSError:
        pass
    return out


def steal(endpoint: str, ns: str, key: str, server_key: str = "") -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if server_key:  # a CURVE client whose key nobody allowed (it knows the daemon's public key)
        public, secret = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_key.encode()
    sock.connect(endpoint)
    out: dict = {"hello": "silent"}
    try:
        welcome = _ask(sock, PeerHello(1, PEER_PROTOCOL_VERSION, "intruder", 1))
        if not isinstance(welcome, PeerWelcome):
            if welcome is not None:
                out["hello"] = f"error: {welcome!r}"
            return out
        out["hello"] = "welcome"
        leased = _ask(sock, Lookup(2, ns, [key], 10.0))
        if not isinstance(leased, Leased):
            out["lookup"] = "silent" if leased is None else f"error: {leased!r}"
            return out
        offer = leased.offers[0]
        out["lookup"] = "none" if offer is None else "offer"
        if offer is not None:
            host = welcome.data_host or endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
            out.update(_read_entry(host, welcome.data_port, offer.token))
        return out
    finally:
        sock.close(0)
        ctx.term()


def main() -> None:
    mode, *args = drop_if_asked(sys.argv[1:])
    if mode == "steal":
        result = steal(*args)
    elif mode == "guess":
        result = _read_entry(args[0], int(args[1]), secrets.token_bytes(32))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps({"uid": os.getuid(), **result}), flush=True)


if __name__ == "__main__":
    main()
