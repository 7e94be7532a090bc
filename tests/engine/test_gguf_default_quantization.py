"""A GGUF file without --quantization keeps its blocks (`gguf`), as llama.cpp and vLLM do; `--quantization
none` widens them to --dtype; where `gguf` cannot run (here: tensor or pipeline parallelism) the file is
widened and the start-up log says why."""

from __future__ import annotations

import torch
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.bench.common import BenchArgs
from pagellm.bench.gguf_convert import convert_hf_checkpoint
from pagellm.core.config import EngineConfig
from pagellm.engine.setup import gguf_default_quantization, resolve_model_source
from pagellm.models.gguf_checkpoint import gguf_architecture
from pagellm.platforms.cpu import CpuPlatform
from pagellm.plugins import load_plugins
from pagellm.worker.step import ModelSource

ENGINE = dict(dtype="float32", num_kv_blocks=64, max_model_len=256)


def _q8_file(tmp_path):
    return convert_hf_checkpoint(
        make_tiny_checkpoint("llama", tmp_path / "hf"), tmp_path / "m.q8_0.gguf", "q8_0"
    )


def _float_weight(linear):
    """The layer's weight, or its packed copy where the platform packed it (float32 panels on AVX2-only
    CPUs)."""
    return linear.weight if linear.weight is not None else linear.packed_weight


def test_a_gguf_file_keeps_its_blocks_unless_told(tmp_path):
    path = _q8_file(tmp_path)
    prompts = [{"prompt_token_ids": [5, 17, 42, 9]}]
    params = SamplingParams(temperature=0, max_tokens=6)

    kept = LLM(str(path), **ENGINE)
    assert kept.engine.setup.quant_method is not None and kept.engine.setup.quant_method.name == "gguf"
    assert any("a GGUF file's default" in line for line in kept.engine.setup.explanation)
    qkv = kept.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight_types == [8, 8, 8]  # Q8_0, the file's bytes
    tokens = kept.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    del kept

    widened = LLM(str(path), quantization="none", **ENGINE)
    assert widened.engine.setup.quant_method is None
    assert any("quantization none (--quantization none)" in line for line in widened.engine.setup.explanation)
    qkv = widened.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert _float_weight(qkv).dtype == torch.float32 and not hasattr(qkv, "qweight_types")
    # Q8_0 on a tiny random model: both give the same greedy tokens (the packed path's error is far
    # below these logits' gaps; a near-tie would show here as a mismatch to look at, not to loosen)
    assert widened.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_the_default_is_widened_with_the_reason_where_gguf_cannot_run(tmp_path):
    path = _q8_file(tmp_path)
    registry = load_plugins()
    for config, expected, note in [
        (EngineConfig(model=str(path)), "gguf", "its blocks kept"),
        (EngineConfig(model=str(path), tensor_parallel_size=2), None, "tensor or pipeline parallelism"),
        (EngineConfig(model=str(path), pipeline_parallel_size=2), None, "tensor or pipeline parallelism"),
        (EngineConfig(model=str(path), batch_invariant=True), None, "--batch-invariant"),
        (EngineConfig(model=str(path), quantization="none"), None, "--quantization none"),
        (EngineConfig(model=str(path), quantization="gguf"), "gguf", ""),
    ]:
        source = resolve_model_source(config)
        requested, why = gguf_default_quantization(config, registry, CpuPlatform, torch.bfloat16, source)
        assert requested == expected and note in why, (config, requested, why)


def test_an_architecture_whose_blocks_are_not_kept_is_widened_by_default(tmp_path):
    """A file of an architecture `--quantization gguf` does not keep packed (its tensors not handed over
    raw) loads widened, as before the default, instead of failing at the weights."""
    import gguf
    import numpy as np

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")  # general.architecture first, as llama.cpp writes it
    writer.add_uint32("gpt2.block_count", 1)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_architecture(path) == "gpt2" and gguf_architecture(tmp_path) is None
    source = ModelSource(str(tmp_path), gguf_original=str(path))
    requested, why = gguf_default_quantization(
        EngineConfig(model=str(path)), load_plugins(), CpuPlatform, torch.bfloat16, source
    )
    assert requested is None and "not gpt2" in why, why
    assert gguf_architecture(_q8_file(tmp_path / "q8")) == "llama"


def test_a_checkpoint_directory_keeps_its_own_quantization(tmp_path):
    directory = make_tiny_checkpoint("llama", tmp_path / "hf")
    config = EngineConfig(model=str(directory))
    source = resolve_model_source(config)
    assert gguf_default_quantization(config, load_plugins(), CpuPlatform, torch.bfloat16, source) == (
        None,
        "",
    )


def test_the_bench_runs_model_s_widened_as_the_workloads_define_it():
    assert BenchArgs(model="S").engine_config().quantization == "none"
    assert BenchArgs(model="S", engine={"quantization": "gguf"}).engine_config().quantization == "gguf"
    assert BenchArgs(model="/some/file.gguf").engine_config().quantization is None  # the engine's default


def test_a_file_of_float_matrices_loads_as_floats(tmp_path):
    """A BF16 or F32 GGUF has no blocks to keep: kept as `gguf` its matrices would skip the platform's
    float kernels (and the native decode step) for a dequantize-per-matmul path; it loads as floats."""
    directory = make_tiny_checkpoint("llama", tmp_path / "hf")
    registry = load_plugins()
    for dtype_name, file_type in [("bfloat16", "BF16"), ("float32", "ALL_F32")]:
        path = convert_hf_checkpoint(directory, tmp_path / f"m.{dtype_name}.gguf", dtype_name)
        config = EngineConfig(model=str(path))
        source = resolve_model_source(config)
        requested, why = gguf_default_quantization(config, registry, CpuPlatform, torch.bfloat16, source)
        assert requested is None and f"a {file_type} GGUF file" in why, why
    llm = LLM(str(path), **ENGINE)
    assert llm.engine.setup.quant_method is None
    assert _float_weight(llm.engine.runner.model.model.layers[0].self_attn.qkv_proj).dtype == torch.float32
