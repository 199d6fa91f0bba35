"""The connectors' split by role (kv_connector.py and ec_connector.py are facades over a scheduler
side and a worker side, sharing metadata.py): each role makes only its own side, and a method of
the other role answers "nothing to do" without a daemon round trip. No daemon runs here: the
endpoint names a socket that does not exist, so any daemon call would back the client off."""
from __future__ import annotations

import pytest

from vllm_env import SKIP_REASON, make_vllm_config, tiny_model_dir  # noqa: F401 (fixture)

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)
if getattr(vllm, "__file__", None) is None:
    # Without vLLM, `import vllm` finds this very directory (tests/vllm) as a namespace package.
    pytest.skip(SKIP_REASON, allow_module_level=True)

import torch  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402

from ecd.integrations.vllm.ec_connector import EcdECConnectorMetadata  # noqa: E402
from ecd.integrations.vllm.ec_scheduler import EcdECConnectorScheduler  # noqa: E402
from ecd.integrations.vllm.ec_worker import EcdECConnectorWorker  # noqa: E402
from ecd.integrations.vllm.kv_connector import EcdKVConnectorMetadata  # noqa: E402
from ecd.integrations.vllm.kv_scheduler import EcdKVConnectorScheduler  # noqa: E402
from ecd.integrations.vllm.kv_worker import EcdKVConnectorWorker  # noqa: E402
from ecd.integrations.vllm.metadata import hashes_per_block, rank_keys, rank_suffix  # noqa: E402

NO_DAEMON = {"endpoint": "ipc:///tmp/ecd-none/ecd.sock"}


class NotARequest:
    request_id = "r"
    mm_features: list = []


def test_kv_each_role_makes_only_its_side_and_answers_the_other_roles_calls_with_nothing(tiny_model_dir):
    config = make_vllm_config(tiny_model_dir, kv_role="kv_both", extra=NO_DAEMON, block_size=16)
    sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, None)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, None)
    assert isinstance(sched.connector_scheduler, EcdKVConnectorScheduler) and sched.connector_worker is None
    assert isinstance(worker.connector_worker, EcdKVConnectorWorker) and worker.connector_scheduler is None
    assert worker.connector_worker.paged is None  # no caches registered yet
    assert sched.client is sched.connector_scheduler.client and worker.client is worker.connector_worker.client

    # the worker's calls on the scheduler's connector
    sched.register_kv_caches({})
    sched.bind_connector_metadata(EcdKVConnectorMetadata())
    sched.start_load_kv(None)
    sched.wait_for_save()
    assert sched.get_block_ids_with_load_errors() == set()
    # the scheduler's calls on a worker's connector
    assert worker.get_num_new_matched_tokens(NotARequest(), 0) == (0, False)
    worker.update_state_after_alloc(NotARequest(), None, 16)
    assert worker.build_connector_meta(SchedulerOutput.make_empty()) == EcdKVConnectorMetadata()
    worker.update_connector_output(None)
    assert worker.request_finished(NotARequest(), []) == (False, None)
    for connector in (sched, worker):
        assert not connector.client.backing_off  # none of it asked the daemon
        connector.shutdown()


def test_ec_each_role_makes_only_its_side_and_answers_the_other_roles_calls_with_nothing(tiny_model_dir):
    config = make_vllm_config(tiny_model_dir, ec_role="ec_both", extra=NO_DAEMON)
    sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    worker = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
    assert isinstance(sched.connector_scheduler, EcdECConnectorScheduler) and sched.connector_worker is None
    assert isinstance(worker.connector_worker, EcdECConnectorWorker) and worker.connector_scheduler is None

    sched.save_caches({"h": torch.zeros(2, 4)}, "h")
    sched.bind_connector_metadata(EcdECConnectorMetadata())
    sched.start_load_caches({})
    assert sched.build_connector_worker_meta() is None
    assert worker.has_cache_item("h") is False
    assert worker.ensure_cache_available(NotARequest(), 0) is True
    assert worker.build_connector_meta(SchedulerOutput.make_empty()) == EcdECConnectorMetadata()
    assert worker.take_unavailable_requests() == set()
    assert worker.request_finished(NotARequest()) == (False, None)
    for connector in (sched, worker):
        assert not connector.client.backing_off
        connector.shutdown()


def test_kv_keys_name_one_entry_per_worker_and_block_size_must_be_whole_hashes():
    assert rank_keys("ab", 1) == ["ab"] and rank_suffix(0, 1) == ""
    assert rank_keys("ab", 3) == ["ab.0", "ab.1", "ab.2"] and rank_suffix(2, 3) == ".2"

    class HashConfig:
        hash_block_size = 16

    assert hashes_per_block(64, HashConfig()) == 4 and hashes_per_block(16, None) == 1
    with pytest.raises(ValueError, match="not a multiple"):
        hashes_per_block(24, HashConfig())
