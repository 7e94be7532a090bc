"""Fixtures of the KV-transfer tests: one tiny float32 checkpoint and one plain engine over it (the single-engine
reference) for the whole session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvt_harness import make_engine
from tiny import make_tiny_checkpoint

from pagellm.engine.llm_engine import LLMEngine

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))  # server_harness


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("kvt"))


@pytest.fixture(scope="session")
def reference(model_dir) -> LLMEngine:
    return make_engine(model_dir)
