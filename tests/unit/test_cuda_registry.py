"""The daemon's CUDA arenas without a GPU: device mapping (ordinals and UUIDs), one exported
arena per device, clean-up on failure and at close, and the config section."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import tomllib

from ecd.config import ConfigError, load_config
from ecd.memory.cuda import CudaArenas, CudaError, DeviceNotFound, resolve_devices

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fake_cuda import UUIDS, FakeDriver  # noqa: E402


def test_ordinals_and_uuids_map_to_ordinals():
    d = FakeDriver()
    assert resolve_devices(d, [0]) == [0]
    assert resolve_devices(d, [1, 0]) == [1, 0]
    assert resolve_devices(d, [UUIDS[1]]) == [1]
    assert resolve_devices(d, ["GPU-" + UUIDS[0][4:].upper(), 1]) == [0, 1]  # case does not matter


def test_unknown_device_names_it_and_the_visible_ones():
    d = FakeDriver()
    with pytest.raises(DeviceNotFound) as info:
        resolve_devices(d, [0, 2])
    assert str(info.value) == (f"no CUDA device 2 on this node (2 visible: 0 {UUIDS[0]}, 1 {UUIDS[1]})")
    with pytest.raises(DeviceNotFound, match="no CUDA device 'GPU-ffff"):
        resolve_devices(d, ["GPU-ffffffff-ffff-ffff-ffff-ffffffffffff"])
    with pytest.raises(DeviceNotFound, match="none visible"):
        resolve_devices(FakeDriver(uuids=[]), [0])


def test_the_same_device_twice_is_refused():
    with pytest.raises(DeviceNotFound, match="already listed"):
        resolve_devices(FakeDriver(), [0, UUIDS[0]])


def test_one_exported_arena_per_device_freed_at_close():
    d = FakeDriver()
    arenas = CudaArenas(d, [1, 0], 4 << 20)
    assert [(a.ordinal, a.uuid, a.size, a.label) for a in arenas] == [
        (1, UUIDS[1], 4 << 20, "cuda1"), (0, UUIDS[0], 4 << 20, "cuda0")]
    assert all(len(a.handle) == 64 for a in arenas)
    assert len(d.live) == 2
    arenas.close()
    assert d.live == {} and len(arenas) == 0
    arenas.close()  # idempotent


def test_a_failed_allocation_frees_the_arenas_made_before_it():
    d = FakeDriver(fail_alloc_on=1)
    with pytest.raises(CudaError, match="OUT_OF_MEMORY"):
        CudaArenas(d, [0, 1], 4 << 20)
    assert d.live == {}


def load_config_text(text: str):
    return load_config(tomllib.loads(text))


def test_config_section():
    cfg = load_config_text('[pool.cuda]\ndevices = [0, "GPU-8d0b3c5e-1f2a-4b6c-9d7e-0f1a2b3c4d5e"]\nsize = "3MiB"\n')
    assert cfg.pool.cuda.devices == [0, "GPU-8d0b3c5e-1f2a-4b6c-9d7e-0f1a2b3c4d5e"]
    assert cfg.pool.cuda.size == 4 << 20  # rounded up to the 2 MiB granularity
    assert load_config_text("").pool.cuda is None
    with pytest.raises(ConfigError, match="pool.cuda.devices"):
        load_config_text('[pool.cuda]\ndevices = []\nsize = "1GiB"\n')


def test_quotas_may_count_the_arenas():
    text = ('[pool.host]\nsize = "1GiB"\n[pool.cuda]\ndevices = [0, 1]\nsize = "2GiB"\n'
            '[namespaces.big]\nquota = "5GiB"\nguaranteed = "4GiB"\n')
    assert load_config_text(text).namespaces["big"].quota == 5 << 30
    with pytest.raises(ConfigError, match=r"plus the CUDA arenas \(5368709120\)"):
        load_config_text(text.replace('quota = "5GiB"', 'quota = "6GiB"'))
    with pytest.raises(ConfigError, match=r"must be <= pool.host.size \(1073741824\)"):
        load_config_text('[pool.host]\nsize = "1GiB"\n[namespaces.big]\nquota = "2GiB"\n')
