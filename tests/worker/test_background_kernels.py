"""The CPU kernels built in the background (`cpu_kernels.build_in_background`, taken up by the model runner's
`_take_up_kernels`): an engine started with compile_in_background does not wait for them, serves on the
PyTorch paths with transformers' tokens, takes them up between two steps, and keeps transformers' tokens; a
failed build leaves the PyTorch paths with the build's reason and is not retried on a step's path."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from parity import Reference, assert_greedy_parity, mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM
from pagellm.models.layers.linear import Linear
from pagellm.platforms import cpu_kernels


class HeldBuild:
    """A background build that ends (successfully) when the test says: the kernels themselves come from this
    session's cache, so only the waiting is faked."""

    def __init__(self):
        self.started = time.monotonic()
        self.log = Path("held-build.log")
        self.process = SimpleNamespace(pid=0, returncode=None, poll=lambda: self.process.returncode)

    def end(self) -> None:
        self.process.returncode = 0

    def failure(self) -> str | None:
        return None


@pytest.fixture
def kernels_here():
    if cpu_kernels.load() is None:
        pytest.skip(f"no native kernels here: {cpu_kernels.why_unavailable()}")


def test_an_engine_serves_while_the_kernels_build_and_takes_them_up_between_steps(
    kernels_here, tmp_path, monkeypatch
):
    path = make_tiny_checkpoint("llama", tmp_path)
    reference = Reference(path, 8)
    build = HeldBuild()
    monkeypatch.setattr(cpu_kernels, "_background", build)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, enforce_eager=True, compile_in_background=True)
    engine, runner = llm.engine, llm.engine.runner
    assert any("kernels are building in the background" in line for line in engine.setup.explanation)
    assert engine.setup.backend_choice.timings == {}, "nothing is timed while the kernels build"
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    attention = runner.model.attention_layers()
    assert runner.kernels_pending and engine.stats().kernels_pending
    assert all(m.weight is not None and m.packed_matmul is None for m in linears)
    assert all(layer.impl.kernel is None for layer in attention), "attention on its PyTorch path"
    prompts = mixed_prompts(llm.get_tokenizer().vocab_size)
    assert_greedy_parity(llm, reference, prompts)
    assert runner.kernels_pending, "still building: the steps did not wait"

    build.end()
    assert_greedy_parity(llm, reference, prompts)  # taken up before the first of these steps
    assert not runner.kernels_pending and not engine.stats().kernels_pending
    assert all(layer.impl.kernel is not None for layer in attention)
    if cpu_kernels.load().isa() == "avx2":  # where the panel kernel takes float32 linears
        assert all(m.weight is None and m.packed_matmul is not None for m in linears)
        assert runner.model.packed_lm_head is not None


def test_a_failed_background_build_leaves_the_pytorch_paths_with_its_reason(tmp_path, monkeypatch):
    """A real child process whose compiler refuses the -march: `load()` answers None while it runs and after,
    with the child's last line as the reason, and never builds in the asking process."""
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(cpu_kernels.ARCH_SWITCH, "no-such-cpu")
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "_background", None)
    monkeypatch.setattr(cpu_kernels, "_why_not", None)
    if cpu_kernels._unbuildable() is not None:
        pytest.skip(cpu_kernels._unbuildable())
    assert cpu_kernels.build_in_background()
    build = cpu_kernels._background
    assert cpu_kernels.build_in_background(), "one build at a time"
    build.process.wait(timeout=240)
    monkeypatch.setattr(cpu_kernels, "_build", lambda: pytest.fail("built in the asking process"))
    assert cpu_kernels.background_build_done()
    assert cpu_kernels.load() is None
    assert cpu_kernels.why_unavailable().startswith("background build exited 1: build failed: ")
    assert "no-such-cpu" in Path(str(build.log)).read_text(), "the compiler's own words are in the log"
    assert cpu_kernels.load() is None and cpu_kernels._background is None


def test_nothing_builds_in_the_background_where_the_kernels_are_built_or_switched_off(
    kernels_here, monkeypatch
):
    monkeypatch.setattr(cpu_kernels, "_background", None)
    assert not cpu_kernels.build_in_background()  # this session's build is in the cache
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    assert not cpu_kernels.build_in_background()  # on disk, not yet loaded: loads in a moment
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert not cpu_kernels.build_in_background()
    assert cpu_kernels._background is None


@pytest.mark.slow
def test_a_background_build_from_an_empty_cache_is_loaded_once_it_ends(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "_background", None)
    if cpu_kernels._unbuildable() is not None:
        pytest.skip(cpu_kernels._unbuildable())
    assert cpu_kernels.build_in_background()
    assert cpu_kernels.load() is None and not cpu_kernels.background_build_done()
    cpu_kernels._background.process.wait(timeout=600)
    kernels = cpu_kernels.load()
    assert kernels is not None and kernels.library.is_relative_to(tmp_path)


def test_a_quantized_model_waits_for_the_background_build_and_stays_packed(
    kernels_here, tmp_path, monkeypatch, caplog
):
    """The build starts as soon as the platform is chosen; a GGUF-quantized model (its blocks stay packed only
    with the kernels) waits for it before loading, then runs on the kernel."""
    import threading

    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    sys_path = Path(__file__).parents[1] / "quantization"
    monkeypatch.syspath_prepend(str(sys_path))
    from quant_formats import quantized_layers, write_quantized

    def q8_0(weight):
        raw = quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
        saved = {"qweight": torch.from_numpy(np.ascontiguousarray(raw)), "qweight_type": torch.tensor(8)}
        return saved, torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0))

    src = make_tiny_checkpoint("llama", tmp_path)
    write_quantized(src, tmp_path / "q", q8_0, {"quant_method": "gguf"})
    build = HeldBuild()
    monkeypatch.setattr(cpu_kernels, "_background", build)
    threading.Timer(1.0, build.end).start()
    with caplog.at_level("INFO", logger="pagellm"):
        llm = LLM(str(tmp_path / "q"), quantization="gguf", num_kv_blocks=64, compile_in_background=True,
                  enforce_eager=True)  # fmt: skip
    assert "waiting for the kernels' build" in caplog.text
    assert not llm.engine.runner.kernels_pending
    assert not any("kernels are building" in line for line in llm.engine.setup.explanation)
    for layer in quantized_layers(llm.engine.runner.model).values():
        assert layer.gguf_paths == ["kernel"] * len(layer.output_sizes)
