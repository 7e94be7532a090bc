"""The CPU kernels built in the background (`cpu_kernels.build_in_background`, taken up by
`RunnerBuild.take_up_kernels`): an engine started with compile_in_background does not wait for them, serves on
the PyTorch paths with transformers' tokens, takes them up between two steps, and keeps transformers' tokens;
a failed build leaves the PyTorch paths with the build's reason and is not retried on a step's path."""

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


def test_a_gguf_model_serves_widened_while_the_kernels_build_then_takes_its_blocks_up(
    kernels_here, tmp_path, monkeypatch
):
    """A GGUF-quantized model does not wait for the build either: the blocks the kernels will read are
    widened at load (the file's bytes kept aside), serve transformers' tokens on the dequantized weights,
    and go back on the kernel between two steps once the build has ended; the widened weights go."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "quantization"))
    from quant_formats import quantized_layers, write_quantized

    def q8_0_or_q5_0(weight):  # two types: Q5_0's fifth bits are widened their own way
        kind = GGMLQuantizationType.Q5_0 if weight.shape[0] % 64 == 0 else GGMLQuantizationType.Q8_0
        raw = quants.quantize(weight.numpy(), kind)
        saved = {
            "qweight": torch.from_numpy(np.ascontiguousarray(raw)),
            "qweight_type": torch.tensor(int(kind)),
        }
        return saved, torch.from_numpy(quants.dequantize(raw, kind))

    reference_path = write_quantized(
        make_tiny_checkpoint("llama", tmp_path), tmp_path / "q", q8_0_or_q5_0, {"quant_method": "gguf"}
    )
    reference = Reference(reference_path, 8)
    build = HeldBuild()
    monkeypatch.setattr(cpu_kernels, "_background", build)
    llm = LLM(str(tmp_path / "q"), quantization="gguf", dtype="float32", num_kv_blocks=128, enforce_eager=True,
              compile_in_background=True)  # fmt: skip
    engine, runner = llm.engine, llm.engine.runner
    assert any("GGUF blocks widened" in line for line in engine.setup.explanation)
    layers = quantized_layers(runner.model).values()
    file_bytes = {id(layer): sum(raw.numel() for raw in layer.gguf_pending.values()) for layer in layers}
    types = {t for layer in layers for t in layer.qweight_types}
    assert types == {int(GGMLQuantizationType.Q5_0), int(GGMLQuantizationType.Q8_0)}
    for layer in layers:
        assert layer.gguf_paths == ["pending"] * len(layer.output_sizes)
        assert all(
            getattr(layer, f"qweight_{i}").dtype == torch.float32 for i in range(len(layer.output_sizes))
        )
    widened_bytes = runner.model_bytes
    prompts = mixed_prompts(llm.get_tokenizer().vocab_size)
    assert_greedy_parity(llm, reference, prompts)
    assert runner.kernels_pending

    build.end()
    assert_greedy_parity(llm, reference, prompts)  # taken up before the first of these steps
    assert not runner.kernels_pending
    for layer in layers:
        assert layer.gguf_paths == ["kernel"] * len(layer.output_sizes) and not layer.gguf_pending
        kept = [getattr(layer, f"qweight_{i}") for i in range(len(layer.output_sizes))]
        assert (
            all(t.dtype == torch.uint8 for t in kept)
            and sum(t.numel() for t in kept) == file_bytes[id(layer)]
        )
    assert runner.model_bytes < widened_bytes


def test_a_gguf_mixture_of_experts_keeps_its_expert_blocks_for_the_kernel_that_builds(
    kernels_here, tmp_path, monkeypatch
):
    """Its experts (Q4_K gate and up, Q6_K down, as a Q4_K_M file holds them) run widened on the PyTorch
    reference while the kernels build and on the GGUF kernel afterwards, the file's expert bytes and no
    widened copy, with the same greedy tokens (float32) as the file dequantized at load; the token embedding
    (Q8_0) is packed then too."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader, quants
    from parity import GGUF_FAMILIES

    from pagellm import SamplingParams
    from pagellm.bench.gguf_convert import convert_hf_checkpoint, reencode_gguf
    from pagellm.models.layers.fused_moe.layer import FusedMoE

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "quantization"))
    from quant_formats import k_quantize

    experts = {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_K, "ffn_down_exps": T.Q6_K}

    def encode(name: str, values: np.ndarray):
        kind = name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]
        if kind in experts:
            e, rows, columns = values.shape
            raw = k_quantize(
                torch.from_numpy(values.reshape(e * rows, columns).copy()), experts[kind]
            ).numpy()
            return raw.reshape(e, rows, -1), experts[kind]
        if kind == "token_embd":
            return quants.quantize(values.astype(np.float32), T.Q8_0), T.Q8_0
        return None

    wide = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256)
    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path, **GGUF_FAMILIES["qwen3_moe"], **wide)
    f32 = convert_hf_checkpoint(checkpoint, tmp_path / "moe.f32.gguf", "float32")
    path = reencode_gguf(f32, tmp_path / "moe.q4_k_m.gguf", "float32", encode)
    expert_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors if t.name.endswith("_exps.weight"))
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(300, seed=3)[8:14]]
    params = SamplingParams(temperature=0, max_tokens=8)

    def greedy(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    engine = dict(dtype="float32", max_model_len=400, kv_cache_space=0.01)
    dequantized = greedy(LLM(str(path), quantization="none", **engine))
    build = HeldBuild()
    monkeypatch.setattr(cpu_kernels, "_background", build)
    llm = LLM(str(path), quantization="gguf", enforce_eager=True, compile_in_background=True, **engine)
    runner = llm.engine.runner
    layers = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(layer.packed is None and layer.pending_gguf_blocks for layer in layers)
    assert runner.model.packed_lm_head is None
    assert greedy(llm) == dequantized

    build.end()
    assert greedy(llm) == dequantized
    assert all(layer.packed.description.startswith("native CPU kernel on GGUF blocks") for layer in layers)
    assert all(layer.w13 is None and layer.pending_gguf_blocks is None for layer in layers)
    packed = sum(b.numel() for layer in layers for b in layer.buffers() if b.dtype == torch.uint8)
    assert packed == expert_bytes
    embedding = runner.model.model.embed_tokens
    table_bytes = next(int(t.n_bytes) for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    assert embedding.weight is None and embedding.packed_table.numel() == table_bytes, (
        "the Q8_0 table in place"
    )


def test_other_quantized_weights_wait_for_the_background_build(kernels_here, tmp_path, monkeypatch, caplog):
    """Weights that stay packed only on the kernels and have no widened stand-in here (int8 per channel)
    wait for the build before loading, then run on them."""
    import threading

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "quantization"))
    from quant_formats import int8_quantizer, write_quantized

    write_quantized(
        make_tiny_checkpoint("llama", tmp_path), tmp_path / "q", int8_quantizer, {"quant_method": "int8"}
    )
    build = HeldBuild()
    monkeypatch.setattr(cpu_kernels, "_background", build)
    threading.Timer(1.0, build.end).start()
    with caplog.at_level("INFO", logger="pagellm"):
        llm = LLM(str(tmp_path / "q"), num_kv_blocks=64, compile_in_background=True, enforce_eager=True)
    assert "waiting for the kernels' build" in caplog.text
    assert not llm.engine.runner.kernels_pending
    assert not any("kernels are building" in line for line in llm.engine.setup.explanation)
