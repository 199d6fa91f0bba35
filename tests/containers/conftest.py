"""Fixtures for tests/containers: a daemon container and client containers (containers_util.py).

Where real containers cannot run (not root, no podman, no image, a stale image) every test here
skips and says why; under `make test-containers` (ECD_CONTAINER_TESTS=1) that is a failure
instead, so a CI job meant to run them never passes without running them.
"""
from __future__ import annotations

import os

import pytest
from containers_util import CLIENT_UID, ContainerNode, probe_features, unavailable_reason


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("ECD_CONTAINER_TESTS") == "1":
        pytest.fail(f"ECD_CONTAINER_TESTS=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def podman_ready() -> None:
    reason = unavailable_reason()
    if reason is not None:
        _skip_or_fail(reason)


@pytest.fixture(scope="session")
def features(podman_ready) -> dict:
    """{"memfd": None or why the image's ecd lacks the fd-passed pool, "admission": likewise}."""
    return probe_features()


def node_config(features: dict) -> str:
    # Admission by uid where the image's ecd has it (issue 24, point 3); without it the clients'
    # group membership (--group-add, the socket is 0660) is what lets them in.
    return f"allowed_uids = [{CLIENT_UID}]" if features["admission"] is None else ""


@pytest.fixture(scope="module")
def node(features):
    n = ContainerNode(node_config(features))
    try:
        n.start_daemon()
        yield n
    finally:
        n.close()


@pytest.fixture
def need_memfd(features) -> None:
    if features["memfd"] is not None:
        pytest.skip("a client in another IPC namespace maps the pool only through the daemon's passed "
                    f"memfds ([pool.host] backing = \"memfd\", issue 24 point 2): {features['memfd']}")


@pytest.fixture
def need_admission(features) -> None:
    if features["admission"] is not None:
        pytest.skip(f"[control] allowed_uids (issue 24 point 3) is not in the image's ecd: {features['admission']}")
