"""A hostile peer daemon, run as its own process by test_peer_data_host.py: a bare ZeroMQ ROUTER
that welcomes every puller with a data port at a host of its choosing and offers every key it is
asked for, so that a puller which believed it would connect there.

    fake_peer.py ENDPOINT DATA_HOST DATA_PORT

Prints "ready" once bound; answers until killed.
"""
from __future__ import annotations

import secrets
import sys

import zmq

from ecd.peer_protocol import (PEER_PROTOCOL_VERSION, Leased, Lookup, Offer, PeerAcked, PeerDone, PeerHello,
                               PeerPing, PeerPong, PeerRelease, PeerWelcome, encoder, peer_request_decoder)


def main() -> None:
    endpoint, data_host, data_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(endpoint)
    print("ready", flush=True)
    decoder = peer_request_decoder()
    while True:
        identity, frame = sock.recv_multipart()
        request = decoder.decode(frame)
        if isinstance(request, PeerHello):
            reply = PeerWelcome(request.id, PEER_PROTOCOL_VERSION, "fake", 1, "tcp", data_host, data_port)
        elif isinstance(request, Lookup):
            reply = Leased(request.id, [Offer(key, 16, "uint8", [16], 0, secrets.token_bytes(32))
                                        for key in request.keys], request.ttl_s)
        elif isinstance(request, PeerPing):
            reply = PeerPong(request.id, 1)
        elif isinstance(request, (PeerRelease, PeerDone)):
            reply = PeerAcked(request.id)
        else:
            continue
        sock.send_multipart([identity, encoder.encode(reply)])


if __name__ == "__main__":
    main()
