"""CPU-visible logic of the client's CUDA data plane (ecd.client.cuda): arena/UUID mapping, tier
choice, the __cuda_array_interface__ built for an arena range, get()'s device argument, handle
and host-registration bookkeeping (against a fake driver), and that a CPU-only client never
imports any of it."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from ecd.client import cuda
from ecd.client.tensors import copy_into, parse_device
from ecd.errors import InvalidRequest
from ecd.integrity import checksum
from ecd.protocol import ArenaInfo

U0 = "GPU-6c3b0c9b-a5d1-4d8e-9f1a-000000000000"
U1 = "GPU-8d0b1e2f-1111-2222-3333-444444444444"
U2 = "GPU-ffffffff-aaaa-bbbb-cccc-dddddddddddd"


def arena(index: int, device_uuid: str) -> ArenaInfo:
    return ArenaInfo(index, device_uuid, 64 << 20, b"\x01" * 64)


# ---- UUIDs and arena mapping ------------------------------------------------------------------

def test_format_uuid_accepts_torch_and_nvidia_smi_spellings():
    raw = uuid.UUID(U1[4:])
    assert cuda.format_uuid(U1) == U1
    assert cuda.format_uuid(U1[4:]) == U1  # str(torch props.uuid) has no prefix
    assert cuda.format_uuid(U1.upper().replace("GPU-", "gpu-")) == U1
    assert cuda.format_uuid(raw.bytes) == U1

    class TorchUuid:  # torch's _CUuuid: .bytes, str() without the prefix
        bytes = raw.bytes

        def __str__(self):
            return str(raw)

    assert cuda.format_uuid(TorchUuid()) == U1

    class TorchUuidAsInts:  # some torch versions give .bytes as a list of 16 ints
        bytes = list(raw.bytes)

        def __str__(self):
            return "not used"

    assert cuda.format_uuid(TorchUuidAsInts()) == U1
    assert cuda.format_uuid("MIG-abc-DEF") == "MIG-abc-def"


def test_map_arenas_by_uuid_not_ordinal():
    arenas = [arena(2, U0), arena(3, U1)]
    # This process sees the daemon's device 1 as its ordinal 0 (CUDA_VISIBLE_DEVICES=1).
    assert cuda.map_arenas(arenas, [U1]) == {3: 0}
    assert cuda.map_arenas(arenas, [U1, U0]) == {2: 1, 3: 0}
    assert cuda.map_arenas(arenas, [U1[4:].upper(), U0]) == {2: 1, 3: 0}
    assert cuda.map_arenas(arenas, []) == {}  # no CUDA: no arena is local
    assert cuda.map_arenas(arenas, [U2]) == {}
    assert cuda.map_arenas([], [U0]) == {}


def test_arenas_by_ordinal_prefers_the_lower_pool():
    assert cuda.arenas_by_ordinal({3: 0, 2: 1}) == {0: 3, 1: 2}
    assert cuda.arenas_by_ordinal({5: 0, 4: 0}) == {0: 4}


# ---- tier choice ------------------------------------------------------------------------------

def test_choose_tier():
    arenas = {0: 2, 1: 3}
    assert cuda.choose_tier(False, None, None, arenas) == cuda.HOST
    assert cuda.choose_tier(False, None, "cuda", arenas) == cuda.HOST  # CPU tensors: always host
    assert cuda.choose_tier(True, 0, None, arenas) == 2
    assert cuda.choose_tier(True, 1, "cuda", arenas) == 3
    assert cuda.choose_tier(True, 1, "host", arenas) == cuda.HOST
    assert cuda.choose_tier(True, 5, None, arenas) == cuda.HOST  # no arena there: fall back
    assert cuda.choose_tier(True, 0, None, {}) == cuda.HOST


def test_choose_tier_cuda_without_an_arena_says_why():
    with pytest.raises(InvalidRequest, match=r"no arena on this tensor's device cuda:5.*cuda:\[0, 1\]"):
        cuda.choose_tier(True, 5, "cuda", {0: 2, 1: 3})
    with pytest.raises(InvalidRequest, match=r"no CUDA arena on cuda:0.*tier=None"):
        cuda.choose_tier(True, 0, "cuda", {})
    with pytest.raises(InvalidRequest, match="tier must be"):
        cuda.choose_tier(True, 0, "gpu", {0: 2})


# ---- __cuda_array_interface__ -----------------------------------------------------------------

def test_cai_dict_describes_a_flat_byte_range():
    cai = cuda.cai_dict(0x7F0000000000, 4096, 1 << 20)
    assert cai == {"shape": (1 << 20,), "typestr": "|u1", "data": (0x7F0000001000, False),
                   "strides": None, "version": 3, "stream": None}
    holder = cuda.DeviceBytes(0x1000, 16, 32)
    assert holder.__cuda_array_interface__["data"] == (0x1010, False)
    for bad in [(0, 0, 1), (0x1000, -1, 1), (0x1000, 0, 0)]:
        with pytest.raises(ValueError):
            cuda.cai_dict(*bad)


# ---- get()'s device argument ------------------------------------------------------------------

@pytest.mark.parametrize("given, expected", [
    (None, None), ("cpu", torch.device("cpu")), ("cpu:0", torch.device("cpu")),
    ("cuda", torch.device("cuda")), ("cuda:1", torch.device("cuda", 1)), (2, torch.device("cuda", 2)),
    (torch.device("cuda", 3), torch.device("cuda", 3)), (torch.device("cpu"), torch.device("cpu")),
])
def test_parse_device(given, expected):
    assert parse_device(given) == expected


@pytest.mark.parametrize("bad", ["mps", "nonsense", -1, True, 1.5, "meta"])
def test_parse_device_refuses(bad):
    with pytest.raises(InvalidRequest):
        parse_device(bad)


# ---- checksums, staging -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.complex64, torch.bool])
def test_tensor_checksum_matches_the_pool_checksum(dtype):
    t = (torch.arange(4096, dtype=torch.float32) * 0.37).to(dtype).reshape(64, 64)[:, ::2]  # strided
    buf = bytearray(t.numel() * t.element_size())
    assert copy_into(buf, 0, t, with_checksum=True) == cuda.tensor_checksum(t) == checksum(buf)
    assert cuda.tensor_checksum(torch.empty(0)) == checksum(b"")


# ---- the plane's bookkeeping against a fake driver --------------------------------------------

class FakeDriver:
    def __init__(self):
        self.calls = []

    def ipc_open_handle(self, ordinal, handle):
        self.calls.append(("open", ordinal, handle))
        return 0x7000_0000_0000 + ordinal

    def ipc_close_handle(self, ordinal, ptr):
        self.calls.append(("close", ordinal, ptr))

    def host_register(self, ptr, size):
        self.calls.append(("register", ptr, size))

    def host_unregister(self, ptr):
        self.calls.append(("unregister", ptr))


@pytest.fixture
def fake_driver(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(cuda, "_driver", lambda: driver)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    return driver


def test_arena_on_an_invisible_device_is_not_local(fake_driver):
    plane = cuda.CudaPlane(7, [arena(1, U2)], [bytearray(4096)], n_host=1)
    assert plane.by_pool == {} and plane.by_ordinal == {}  # CPU build: no local devices at all
    with pytest.raises(InvalidRequest, match=f"CUDA arena on device {U2}.*cannot see"):
        plane.location_tensor(1, 0, 16, "float32", [4])
    assert plane.tier_for(torch.zeros(4), None) == cuda.HOST
    assert fake_driver.calls == []


def test_handles_open_once_and_close_with_the_plane(fake_driver):
    plane = cuda.CudaPlane(7, [arena(1, U0), arena(2, U1)], [bytearray(4096)], n_host=1)
    plane.by_pool = {1: 0, 2: 1}  # as map_arenas would on a 2-GPU node
    assert plane.arena_base(1) == plane.arena_base(1) == 0x7000_0000_0000
    assert plane.arena_base(2) == 0x7000_0000_0001
    assert [c[0] for c in fake_driver.calls] == ["open", "open"]
    plane.close()
    plane.close()
    assert sorted(c for c in fake_driver.calls if c[0] == "close") == [
        ("close", 0, 0x7000_0000_0000), ("close", 1, 0x7000_0000_0001)]


def test_host_pool_registered_once_then_unregistered(fake_driver):
    import mmap
    bufs = [mmap.mmap(-1, 1 << 16), mmap.mmap(-1, 1 << 17)]
    plane = cuda.CudaPlane(7, [], bufs, n_host=2)
    t = plane.host_tensor(1, 4096, 64, "float32", [4, 4])
    assert t.shape == (4, 4) and t.dtype == torch.float32 and t.device.type == "cpu"
    t.fill_(1.5)
    assert bytes(bufs[1][4096:4100]) == torch.tensor([1.5]).numpy().tobytes()
    plane.host_tensor(0, 0, 8, "bfloat16", [4])
    registered = [c for c in fake_driver.calls if c[0] == "register"]
    assert [c[2] for c in registered] == [1 << 16, 1 << 17]  # each whole mapping, once
    assert registered[0][1] == cuda.buffer_address(bufs[0])
    assert plane.extent_checksum(1, 4096, 64) == checksum(bufs[1], 4096, 64)
    del t
    plane.close()
    assert sorted(c[1] for c in fake_driver.calls if c[0] == "unregister") == sorted(c[1] for c in registered)


def test_failed_registration_warns_and_copies_still_work(monkeypatch):
    from ecd.errors import EcdError

    def broken():
        raise EcdError("no CUDA driver")

    monkeypatch.setattr(cuda, "_driver", broken)
    plane = cuda.CudaPlane(7, [], [bytearray(4096)], n_host=1)
    with pytest.warns(RuntimeWarning, match="cannot register the host pool"):
        plane.host_tensor(0, 0, 16, "int32", [4])
    plane.host_tensor(0, 0, 16, "int32", [4])  # tried once only
    plane.close()


def test_an_empty_batch_waits_for_nothing():
    batch = cuda.CudaPlane(7, [], [], n_host=0).batch()
    batch.wait()
    batch.wait_quietly()


# ---- a CPU-only client never loads the CUDA plane ---------------------------------------------

def test_cpu_client_never_imports_the_cuda_plane(daemon):
    script = textwrap.dedent(f"""
        import sys, torch
        from ecd import Client
        c = Client({daemon.endpoint!r})
        c.put("a", torch.arange(1 << 16, dtype=torch.float32))
        c.put("small", torch.ones(3))
        c.put_many({{"b": torch.zeros(1 << 14), "c": torch.ones(1 << 14)}}, tier="host")
        c.put("d", torch.ones(1 << 14), tier="cuda")  # CPU tensors always go to the host pool
        assert torch.equal(c.get("a"), torch.arange(1 << 16, dtype=torch.float32))
        assert torch.equal(c.get("a", device="cpu"), torch.arange(1 << 16, dtype=torch.float32))
        assert c.get_many(["b", "c"], device=torch.device("cpu"))[1].sum() == 1 << 14
        with c.view("a") as v:
            assert v[3] == 3
        c.exists(["a", "zz"])
        c.close()
        assert "ecd.client.cuda" not in sys.modules, "ecd.client.cuda was imported"
        assert not torch.cuda.is_initialized()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_client_refuses_unknown_tier_and_device(daemon):
    with daemon.client() as c:
        with pytest.raises(InvalidRequest, match="tier must be"):
            c.put("a", torch.ones(4), tier="gpu")
        c.put("a", torch.ones(1 << 12))
        with pytest.raises(InvalidRequest, match="cpu or cuda"):
            c.get("a", device="meta")


def test_mapping_accepts_arena_locations_and_places_reservations_by_tier():
    from ecd.client.mapping import EpochMapping
    from ecd.errors import ProtocolError
    from ecd.protocol import Extent, Location
    m = object.__new__(EpochMapping)  # the bookkeeping only: no shared memory attached
    m.sizes, m.arena_sizes = [1000], {1: 2000}

    def loc(pool, offset, nbytes):
        return Location(1, pool, offset, nbytes, "uint8", [nbytes])

    m.check(loc(0, 500, 500))
    m.check(loc(1, 1000, 1000))
    for bad in [loc(0, 600, 500), loc(1, 1500, 600), loc(2, 0, 1), loc(-1, 0, 1)]:
        with pytest.raises(ProtocolError):
            m.check(bad)
    assert not m.is_arena(0) and m.is_arena(1)
    assert m.fits(Extent(1, 0, 0), -1) and not m.fits(Extent(1, 1, 0), -1)
    assert m.fits(Extent(1, 1, 0), 1) and not m.fits(Extent(1, 0, 0), 1)
