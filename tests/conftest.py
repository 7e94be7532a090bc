"""Shared test set-up: the helpers in tests/models (`tiny` checkpoints, the `parity` oracle) import everywhere,
and the session runs on one device (`--device`)."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "models"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default=None,
        help="platform the engines and the transformers references run on (cpu, cuda, ...): sets PAGELLM_DEVICE "
        "for the session [default: PAGELLM_DEVICE if set, else cpu]",
    )


def pytest_configure(config: pytest.Config) -> None:
    """The device is set for the whole session, and cpu unless asked: left to auto, a GPU machine would run
    the engines on CUDA and the references on the CPU. Engine processes the tests start inherit it."""
    os.environ["PAGELLM_DEVICE"] = config.getoption("device") or os.environ.get("PAGELLM_DEVICE") or "cpu"


@pytest.fixture
def two_threads():
    """Two torch threads for this test, whatever the session has: tox runs the suite in two workers of one
    thread each (OMP_NUM_THREADS=1), and a native kernel that splits its work across threads is checked
    only when there are threads to split it across."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton kernels run in its interpreter, on CPU tensors, for this test only (kernels are jitted per
    mode, so a session that also compiles them for a device is not affected)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture(autouse=True)
def compiled_forwards_of_this_test(tmp_path, monkeypatch):
    """Each test compiles into a folder of its own: a compiled forward another test (or an earlier run of
    the suite) saved would be loaded instead of compiled, and the test would check the load, not the compile."""
    from pagellm.worker import compiled_forward

    folder = tmp_path / "compiled"
    monkeypatch.setattr(compiled_forward, "compiled_dir", lambda: folder)
    return folder


@pytest.fixture
def idle_machine(monkeypatch):
    """The selector's load probe reports an idle machine: tests that check which backend the timings pick
    would otherwise see the other test workers' load and get the platform's order."""
    from pagellm.core import selector

    monkeypatch.setattr(selector, "_cpu_load", lambda: lambda: 0.0)
