"""ecd/memory/disk.py on its own: records written and read back bit-identical through every path
(O_DIRECT in place, O_DIRECT through the bounce buffer for unaligned memory, buffered), sizes
around the block and chunk boundaries, long names (a header over one block), and every way a
record can be wrong: flipped data, flipped header, truncated, deleted, another entry's header,
bytes that no longer match the producer's checksum."""
from __future__ import annotations

import mmap
import os

import pytest

from ecd.memory import disk as files

SIZES = [0, 1, 4095, 4096, 4097, (4 << 20) + 3, (9 << 20) + 4096 * 3 + 17]


def header(key: str, nbytes: int, ns: str = "ns", seq: int = 1) -> files.RecordHeader:
    return files.RecordHeader(ns, key, "uint8", (nbytes,), nbytes, 0, 5, seq, 0, False)


def buffer(nbytes: int, shift: int) -> tuple[mmap.mmap, memoryview]:
    buf = mmap.mmap(-1, max(nbytes + shift, 1))
    view = memoryview(buf)[shift:shift + nbytes]
    view[:] = os.urandom(nbytes)
    return buf, view


@pytest.fixture
def tier(tmp_path):
    path = tmp_path / "tier"
    path.mkdir()
    fd = os.open(path, os.O_RDONLY)
    yield str(path), fd
    os.close(fd)


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def direct(request, tier):
    if request.param and not files.probe_direct_io(tier[0]):
        pytest.skip("this filesystem takes no O_DIRECT")
    return request.param


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("shift", [0, 256], ids=["aligned", "unaligned"])
def test_round_trip_is_bit_identical(tier, direct, nbytes, shift):
    path, fd = tier
    _, src = buffer(nbytes, shift)
    h = header("k", nbytes)
    name = files.write_record(path, fd, h, src, direct, sync=True)
    assert h.checksum == files.checksum_of(src)
    assert os.path.getsize(os.path.join(path, name)) == h.file_size == files.record_size("ns", "k", "uint8", 1, nbytes)
    assert not [n for n in os.listdir(path) if n.endswith(".tmp")]
    got, dst = buffer(nbytes, shift)
    files.read_record(path, name, h, dst, direct)
    assert bytes(dst) == bytes(src)
    back, size = files.read_header(path, name)
    assert back == h and size == h.file_size


def test_a_long_key_takes_a_longer_header(tier, direct):
    path, fd = tier
    key = "k" * 9000
    _, src = buffer(5000, 0)
    h = header(key, 5000)
    assert h.header_len == 3 * files.HEADER_UNIT
    name = files.write_record(path, fd, h, src, direct, sync=False)
    _, dst = buffer(5000, 0)
    files.read_record(path, name, h, dst, direct)
    assert bytes(dst) == bytes(src) and files.read_header(path, name)[0].key == key


def written(tier, direct, nbytes: int = 100_000) -> tuple[str, files.RecordHeader, memoryview]:
    path, fd = tier
    _, src = buffer(nbytes, 0)
    h = header("k", nbytes)
    return files.write_record(path, fd, h, src, direct, sync=False), h, src


def flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))


@pytest.mark.parametrize("damage, kind", [
    ("data", "corrupt"), ("header", "header"), ("truncate", "truncated"), ("delete", "missing"),
    ("padding-only", None)])
def test_a_damaged_record_is_refused(tier, direct, damage, kind):
    path, _ = tier
    name, h, src = written(tier, direct)
    file = os.path.join(path, name)
    if damage == "data":
        flip(file, h.header_len + 99_999)  # the last byte of the entry
    elif damage == "header":
        flip(file, 100)  # the key's bytes: the header's own checksum catches it
    elif damage == "truncate":
        os.truncate(file, h.file_size - 4096)
    elif damage == "delete":
        os.unlink(file)
    else:
        flip(file, h.file_size - 1)  # zero padding after the entry: not part of it
    _, dst = buffer(h.nbytes, 0)
    if kind is None:
        files.read_record(path, name, h, dst, direct)
        assert bytes(dst) == bytes(src)
        return
    with pytest.raises(files.DiskIOError) as err:
        files.read_record(path, name, h, dst, direct)
    assert err.value.kind == kind
    if damage in ("header", "truncate"):
        with pytest.raises(files.DiskIOError):
            files.read_header(path, name)


def test_a_record_of_another_entry_is_refused(tier, direct):
    path, _ = tier
    name, h, _ = written(tier, direct)
    other = header("other", h.nbytes)
    other.checksum = h.checksum
    _, dst = buffer(h.nbytes, 0)
    with pytest.raises(files.DiskIOError, match="another entry"):
        files.read_record(path, name, other, dst, direct)


def test_bytes_that_went_bad_in_memory_are_never_written(tier, direct):
    path, fd = tier
    _, src = buffer(50_000, 0)
    with pytest.raises(files.DiskIOError) as err:
        files.write_record(path, fd, header("k", 50_000), src, direct, sync=False,
                           expect=files.checksum_of(src) ^ 1)
    assert err.value.kind == "corrupt" and os.listdir(path) == []


def test_listing_separates_records_from_leftover_temporary_files(tier):
    path, fd = tier
    _, src = buffer(10, 0)
    name = files.write_record(path, fd, header("k", 10), src, False, sync=False)
    open(os.path.join(path, "x.ecd.tmp"), "w").close()
    open(os.path.join(path, "notes.txt"), "w").close()
    assert files.list_directory(path) == ([name], ["x.ecd.tmp"])
