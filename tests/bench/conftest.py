"""Fixtures of the `pagellm bench` tests."""

from __future__ import annotations

import pytest
from tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint (one per test module)."""
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("bench")))
