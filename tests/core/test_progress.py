"""Progress bars: silent where stderr is no terminal (logs, pipes, these captured tests), drawn at a terminal
or when PAGELLM_PROGRESS=1 forces them; and the long waits that use them (GGUF tensors, the CPU kernels'
build) do draw them."""

from __future__ import annotations

import io
import sys
import time

import pytest

from pagellm.core import progress as progress_module
from pagellm.core.progress import elapsed, progress, progress_enabled


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def no_switch(monkeypatch):
    monkeypatch.delenv(progress_module.ENV_SWITCH, raising=False)


def test_quiet_when_stderr_is_not_a_terminal(capsys):
    assert list(progress(range(5), desc="reading")) == [0, 1, 2, 3, 4]
    with elapsed("building"):
        time.sleep(0.05)
    assert capsys.readouterr().err == ""


def test_drawn_at_a_terminal(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert progress_enabled()
    assert list(progress(iter(range(3)), desc="reading", total=3, unit="tensor")) == [0, 1, 2]
    assert "reading:" in terminal.getvalue() and "/3 " in terminal.getvalue()


def test_the_switch_forces_them_on_and_off(monkeypatch, capsys):
    monkeypatch.setenv(progress_module.ENV_SWITCH, "1")
    list(progress(range(4), desc="forced"))
    with elapsed("building the thing", interval=0.01):
        time.sleep(0.1)
    err = capsys.readouterr().err
    assert "forced:" in err and "/4 " in err
    assert "building the thing: 00:00" in err
    monkeypatch.setenv(progress_module.ENV_SWITCH, "0")
    assert not progress_enabled(Terminal())


def test_gguf_tensors_draw_a_bar(tmp_path, monkeypatch, capsys):
    from parity import GGUF_FAMILIES
    from tiny import make_tiny_checkpoint

    from pagellm.bench.gguf_convert import convert_hf_checkpoint
    from pagellm.models.gguf_checkpoint import iter_gguf_weights, load_gguf

    checkpoint = make_tiny_checkpoint("qwen2", tmp_path, **GGUF_FAMILIES.get("qwen2", {}))
    path = convert_hf_checkpoint(checkpoint, tmp_path / "m.q8_0.gguf", "q8_0")
    config, _, _ = load_gguf(path)
    capsys.readouterr()
    quiet = dict(iter_gguf_weights(path, config))
    assert "GGUF tensors" not in capsys.readouterr().err
    monkeypatch.setenv(progress_module.ENV_SWITCH, "1")
    shown = dict(iter_gguf_weights(path, config))
    assert shown.keys() == quiet.keys()
    assert "GGUF tensors" in capsys.readouterr().err


def test_a_fresh_kernel_build_shows_its_elapsed_time(tmp_path, monkeypatch, capsys):
    """The build itself is faked (a real one takes half a minute): what is checked is the line while it runs."""
    import torch.utils.cpp_extension

    from pagellm.platforms import cpu_kernels

    def slow_failing_build(**kwargs):
        time.sleep(0.7)
        raise RuntimeError("no compiler here")

    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", sys.executable)  # any program on PATH passes the compiler check
    monkeypatch.delenv(cpu_kernels.ENV_SWITCH, raising=False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", slow_failing_build)
    monkeypatch.setenv(progress_module.ENV_SWITCH, "1")
    kernels, why = cpu_kernels._build()
    assert kernels is None and "no compiler here" in why
    assert "building the CPU kernels: 00:00" in capsys.readouterr().err
