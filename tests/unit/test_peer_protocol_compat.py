"""The nixl fields of the peer protocol were added at the end with defaults: a daemon built
before them and one built after still understand each other (version 1 both)."""
from __future__ import annotations

import msgspec
from msgspec import Struct

from ecd.peer_protocol import Leased, Offer, PeerDone, PeerWelcome, encoder, peer_reply_decoder, peer_request_decoder


class OldWelcome(Struct, array_like=True, tag="peer_welcome", omit_defaults=False):
    id: int
    version: int
    node: str
    epoch: int
    transport: str
    data_host: str
    data_port: int


class OldOffer(Struct, array_like=True):
    key: str
    nbytes: int
    dtype: str
    shape: list[int]
    checksum: int
    token: bytes


def test_old_welcome_decodes_with_an_empty_agent():
    old = msgspec.msgpack.encode(OldWelcome(1, 1, "a", 7, "tcp", "", 7481))
    got = peer_reply_decoder().decode(old)
    assert isinstance(got, PeerWelcome) and got.agent == b"" and got.data_port == 7481


def test_new_welcome_decodes_at_an_old_daemon():
    new = encoder.encode(PeerWelcome(1, 1, "a", 7, "nixl", "", 7480, b"\x00metadata"))
    got = msgspec.msgpack.decode(new, type=OldWelcome)
    assert got.transport == "nixl" and got.data_port == 7480


def test_offers_carry_addr_and_old_offers_decode_with_zero():
    token = b"t" * 32
    old = msgspec.msgpack.encode(OldOffer("k", 4, "uint8", [4], 0, token))
    assert msgspec.msgpack.decode(old, type=Offer).addr == 0
    leased = encoder.encode(Leased(3, [Offer("k", 4, "uint8", [4], 0, token, 0x7F00_0000_1000), None], 5.0))
    got = peer_reply_decoder().decode(leased)
    assert got.offers[0].addr == 0x7F00_0000_1000 and got.offers[1] is None
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(got.offers[0]), type=OldOffer).token == token


def test_peer_done_round_trips():
    got = peer_request_decoder().decode(encoder.encode(PeerDone(9, [b"a" * 32, b"b" * 32])))
    assert isinstance(got, PeerDone) and got.tokens == [b"a" * 32, b"b" * 32]


def test_offer_meta_is_trailing_and_optional():
    from ecd.protocol import EncoderMeta
    new = encoder.encode(Leased(3, [Offer("k", 8, "uint8", [8], 0, b"t" * 32, 0, EncoderMeta("h", 4))], 5.0))
    got = peer_reply_decoder().decode(new)
    assert got.offers[0].meta == EncoderMeta("h", 4)
    old_view = msgspec.msgpack.decode(msgspec.msgpack.encode(msgspec.msgpack.decode(new)[2][0]), type=OldOffer)
    assert old_view.key == "k" and old_view.token == b"t" * 32  # an old daemon ignores the trailing meta
    old = msgspec.msgpack.encode(["leased", 3, [OldOffer("k", 8, "uint8", [8], 0, b"t" * 32)], 5.0])
    assert peer_reply_decoder().decode(old).offers[0].meta is None
