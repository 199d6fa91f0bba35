"""Checksums end to end, without a daemon: the store keeps them, replies carry them, verify
namespaces refuse puts without them, and the wire format stays readable by older peers."""
from __future__ import annotations

import mmap

import msgspec
import numpy as np
import pytest
import torch
import xxhash

from ecd.client.tensors import CHECKSUM_CHUNK, copy_into, copy_out_checked
from ecd.daemon.registry.entries import State
from ecd.errors import Code, IntegrityError, error_from_code
from ecd.integrity import EMPTY_CHECKSUM, checksum
from ecd.protocol import Commit, Location, Report, encoder, reply_decoder, request_decoder
from test_store import Env, item


def verify_env(**kw) -> Env:
    env = Env(**kw)
    env.store.verify_namespaces = frozenset({"safe"})
    return env


# ---- store ----------------------------------------------------------------------------------

def test_commit_stores_the_checksum_and_the_location_carries_it():
    env = Env()
    s = env.session()
    ext = env.alloc(s, "k")
    assert env.store.commit(s, ext.generation, 0xDEADBEEF) is None
    assert env.store.by_generation[ext.generation].checksum == 0xDEADBEEF
    (loc,) = env.get(env.session(), ["k"])
    assert isinstance(loc, Location) and loc.checksum == 0xDEADBEEF
    env.check()


def test_commit_without_checksum_stores_none():
    env = Env()
    s = env.session()
    env.put(s, "k")
    assert env.lease(env.session(), "k").checksum == 0
    env.check()


def test_replacement_carries_the_new_checksum_and_readers_of_the_old_keep_theirs():
    env = Env()
    w, r = env.session(), env.session()
    first = env.alloc(w, "k")
    env.store.commit(w, first.generation, 111)
    old = env.lease(r, "k")
    second = env.alloc(w, "k")
    env.store.commit(w, second.generation, 222)
    assert old.checksum == 111
    assert env.store.by_generation[first.generation].state is State.RETIRED
    assert env.lease(env.session(), "k").checksum == 222
    env.check()


def test_publish_of_a_reservation_stores_the_checksum():
    env = Env()
    s = env.reserving(env.session())
    ext = env.store.reserve(s, 64)
    assert env.store.publish(s, "ns", ext.generation, item("k", 64), 2**64 - 1) is None
    assert env.lease(env.session(), "k").checksum == 2**64 - 1
    env.check()


def test_verify_namespace_refuses_a_commit_without_checksum_and_frees_the_write():
    env = verify_env()
    s = env.session()
    ext = env.alloc(s, "k", ns="safe")
    failure = env.store.commit(s, ext.generation)
    assert failure.code == Code.INVALID
    assert "'safe'" in failure.message and "verify = true" in failure.message and "'k'" in failure.message
    assert ext.generation not in env.store.by_generation and not s.writes and env.used() == 0
    assert not env.present("k", ns="safe")
    # with a checksum it goes in; other namespaces need none
    ext = env.alloc(s, "k", ns="safe")
    assert env.store.commit(s, ext.generation, 7) is None
    env.put(s, "k", ns="other")
    assert env.present("k", ns="safe") and env.present("k", ns="other")
    env.check()


def test_verify_namespace_refuses_a_publish_without_checksum():
    env = verify_env()
    s = env.reserving(env.session())
    ext = env.store.reserve(s, 64)
    failure = env.store.publish(s, "safe", ext.generation, item("k", 64))
    assert failure.code == Code.INVALID and "checksum" in failure.message
    assert s.reservation is None and not s.writes and env.used() == 0
    ext = env.store.reserve(s, 64)
    assert env.store.publish(s, "safe", ext.generation, item("k", 64), 5) is None
    env.check()


# ---- checksums of copies --------------------------------------------------------------------

@pytest.mark.parametrize("nbytes", [0, 1, 4096, CHECKSUM_CHUNK - 1, CHECKSUM_CHUNK, 3 * CHECKSUM_CHUNK + 17])
def test_chunked_copy_checksum_equals_one_shot_xxh3(nbytes):
    src = torch.from_numpy(np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8))
    buf = mmap.mmap(-1, nbytes + 128)
    digest = copy_into(buf, 64, src, with_checksum=True)
    assert digest == (xxhash.xxh3_64_intdigest(src.numpy().tobytes()) or 1)
    assert digest == checksum(buf, 64, nbytes)
    out, back = copy_out_checked(buf, 64, nbytes, "uint8", [nbytes])
    assert back == digest and torch.equal(out, src)
    assert copy_into(buf, 64, src) == 0  # not asked: not computed
    if nbytes == 0:
        assert digest == EMPTY_CHECKSUM
    buf.close()  # every memoryview was released: the mmap can close


def test_checksum_of_a_strided_tensor_is_that_of_its_row_major_bytes():
    t = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64).t()
    buf = bytearray(t.numel() * 4)
    digest = copy_into(buf, 0, t, with_checksum=True)
    assert digest == checksum(t.contiguous().numpy().tobytes())
    t16 = torch.arange(1000, dtype=torch.bfloat16)
    buf = bytearray(2000)
    assert copy_into(buf, 0, t16, with_checksum=True) == checksum(bytes(buf))


def test_checksum_is_never_zero():
    assert checksum(b"") == EMPTY_CHECKSUM != 0
    assert checksum(b"abc") == xxhash.xxh3_64_intdigest(b"abc")


# ---- wire format ----------------------------------------------------------------------------

def test_new_fields_are_trailing_with_defaults():
    dec = request_decoder()
    # an older client's Commit / Publish / PutInline (no checksum fields) still decodes
    assert dec.decode(msgspec.msgpack.encode(["commit", 1, [5], 0])) == Commit(1, [5], 0, [])
    assert dec.decode(msgspec.msgpack.encode(["put_inline", 2, "ns", "k", "uint8", [1], b"x"])).checksum == 0
    assert dec.decode(msgspec.msgpack.encode(["report", 0, 1])) == Report(0, 1, 0)
    # full 64-bit digests travel
    assert dec.decode(encoder.encode(Commit(1, [5], 0, [2**64 - 1]))).checksums == [2**64 - 1]
    with pytest.raises(msgspec.ValidationError):
        dec.decode(msgspec.msgpack.encode(["commit", 1, [5], 0, [-1]]))
    # an older client's Location (no checksum) decodes as "none stored"; a Location with one
    # decodes for a client that does not know the field (trailing array items are ignored)
    rdec = reply_decoder()
    old = rdec.decode(msgspec.msgpack.encode(["acquired", 3, [["location", 1, 0, 0, 4, "uint8", [4]]]]))
    assert old.results[0].checksum == 0

    class OldLocation(msgspec.Struct, array_like=True, tag="location"):
        generation: int
        pool: int
        offset: int
        nbytes: int
        dtype: str
        shape: list[int]

    assert msgspec.msgpack.decode(encoder.encode(Location(1, 0, 0, 4, "uint8", [4], 99)),
                                  type=OldLocation).nbytes == 4


def test_integrity_error_from_a_reply_code():
    err = error_from_code(Code.CORRUPT, "inline put of 'k': mismatch")
    assert isinstance(err, IntegrityError) and err.key is None
