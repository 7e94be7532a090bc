"""Fixtures of the server tests: one tiny random-weight checkpoint for the whole session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from tiny import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("serve"))
