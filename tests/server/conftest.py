"""Fixtures of the server tests: one tiny random-weight checkpoint for the whole session."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("serve"))
