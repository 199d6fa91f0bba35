"""Fixtures for the vLLM connector tests (helpers live in vllm_env.py)."""
from __future__ import annotations

import pytest

from vllm_env import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-paligemma"))
