"""Shared test set-up: the helpers in tests/models (`tiny` checkpoints, the `parity` oracle) import everywhere."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "models"))


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton kernels run in its interpreter, on CPU tensors, for this test only (kernels are jitted per
    mode, so a session that also compiles them for a device is not affected)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
