"""Gemma 2, Gemma 3, Phi-3 and the mixtures of experts as llama.cpp writes them (pagellm.bench.gguf_convert): the engine on the GGUF
file gives the greedy tokens of transformers on the original checkpoint, each variant with a field that
transformers' own GGUF reader drops (so transformers on the GGUF file is no oracle for them);
`--quantization gguf` on a Q8_0 file gives the tokens of the same file dequantized at load. Phi-3 with
LongRoPE and partial rotary (Phi-4-mini's) runs by default, the other families under -m slow (the MoE
files' loading is checked by default in tests/models/test_models_gguf.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parity import GGUF_FAMILIES, Reference, assert_greedy_parity, max_logprob_error, mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.bench.gguf_convert import convert_hf_checkpoint

MAX_TOKENS = 8
ENGINE = dict(dtype="float32", max_model_len=400, kv_cache_space=0.01)
LOGPROB_TOLERANCE = 1e-3
"""float32 on both sides; the log-probabilities catch what greedy tokens of the tiny models may not (Gemma
2's soft-caps and attention scale leave its greedy tokens as they are)."""


def _gguf(family: str, root: Path, type_name: str = "float32") -> tuple[Path, Path]:
    """(the tiny checkpoint, its GGUF file)."""
    checkpoint = make_tiny_checkpoint(family.split("-")[0], root, **GGUF_FAMILIES[family])
    return checkpoint, convert_hf_checkpoint(checkpoint, root / f"tiny-{family}.{type_name}.gguf", type_name)


@pytest.mark.parametrize(
    "family",
    [
        "phi3-longrope",
        pytest.param("phi3-partial-rotary", marks=pytest.mark.slow),
        pytest.param("gemma2-softcaps", marks=pytest.mark.slow),
        pytest.param("gemma3_text-linear-rope", marks=pytest.mark.slow),
        pytest.param("qwen3_moe", marks=pytest.mark.slow),
        pytest.param("qwen2_moe", marks=pytest.mark.slow),
        pytest.param("mixtral", marks=pytest.mark.slow),
    ],
)
def test_gguf_family_matches_the_original_checkpoint(family, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    checkpoint, gguf = _gguf(family, tmp_path)
    llm = LLM(str(gguf), quantization="none", **ENGINE)
    prompts = mixed_prompts(300, seed=2)[::4]  # 1 to 128 tokens, across the 32-token windows
    reference = Reference(checkpoint, MAX_TOKENS)
    assert_greedy_parity(llm, reference, prompts)
    error = max_logprob_error(llm, reference, prompts, MAX_TOKENS)
    assert error < LOGPROB_TOLERANCE, error


def _tokens_dequantized_and_packed(path: Path, seed: int) -> tuple[dict, LLM]:
    """Greedy tokens of six prompts with the file dequantized at load ("none") and kept packed ("gguf"), and
    the packed engine."""
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(300, seed=seed)[8:14]]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = {}
    for quantization in ("none", "gguf"):
        llm = LLM(str(path), quantization=quantization, **ENGINE)
        outputs[quantization] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    return outputs, llm


@pytest.mark.parametrize(
    "family",
    [
        "phi3",
        pytest.param("gemma2", marks=pytest.mark.slow),
        pytest.param("gemma3_text", marks=pytest.mark.slow),
    ],
)
def test_q8_0_gguf_kept_packed_gives_the_dequantized_tokens(family, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    _, gguf = _gguf(family, tmp_path, "q8_0")
    outputs, llm = _tokens_dequantized_and_packed(gguf, seed=3)
    layer = llm.engine.runner.model.model.layers[0]
    assert type(layer.self_attn.qkv_proj.quant_method).__name__ == "GgufMethod"
    assert layer.mlp.gate_up_proj.qweight_types == [8, 8]  # Q8_0 for gate and up
    assert outputs["gguf"] == outputs["none"]


@pytest.mark.slow
def test_q8_0_moe_gguf_keeps_the_experts_packed(tmp_path, monkeypatch):
    """Qwen3-MoE in Q8_0 under `--quantization gguf`: attention and the stacked Q8_0 experts kept packed
    (the experts on `pagellm::gguf_moe`), the float32 routers loaded as floats; the tokens of the file
    dequantized whole. (How near the dequantized experts are to the original ones:
    tests/models/test_models_gguf.py; K-quant experts: tests/engine/test_gguf_moe_experts.py.)"""
    from pagellm.platforms import cpu_gguf

    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    _, gguf = _gguf("qwen3_moe", tmp_path, "q8_0")
    prompts = mixed_prompts(300, seed=3)[8:14]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = {}
    for quantization in ("gguf", "none"):
        llm = LLM(str(gguf), quantization=quantization, **ENGINE)
        outputs[quantization] = [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ]
        if quantization == "gguf":
            layer = llm.engine.runner.model.model.layers[0]
            assert layer.self_attn.qkv_proj.qweight_types == [8, 8, 8]  # q, k, v kept packed
            if cpu_gguf.available():
                assert "GGUF blocks (Q8_0, Q8_0, Q8_0)" in layer.mlp.experts.packed.description
    assert outputs["gguf"] == outputs["none"]


def test_q8_0_tied_embedding_stays_packed_at_the_file_size(tmp_path, monkeypatch):
    """A Llama file with a tied Q8_0 token embedding (as SmolLM2's): under `--quantization gguf` on CPU the
    embedding's rows and the logits come from the file's blocks, no float copy is kept, the weights take
    the file's tensor bytes, and the greedy tokens are those of the file dequantized at load."""
    import gguf

    from pagellm.models.loader import model_weight_bytes
    from pagellm.platforms import cpu_gguf

    if not cpu_gguf.available():
        pytest.skip("the native CPU kernels are not built here")
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    checkpoint = make_tiny_checkpoint("llama", tmp_path, tie_word_embeddings=True, hidden_size=128)
    path = convert_hf_checkpoint(checkpoint, tmp_path / "tiny-llama.q8_0.gguf", "q8_0")
    outputs, llm = _tokens_dequantized_and_packed(path, seed=4)
    model = llm.engine.runner.model
    assert model.model.embed_tokens.weight is None
    assert model.packed_lm_head is not None and model.packed_lm_head.weight.dtype == torch.uint8
    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    assert model_weight_bytes(model) == pytest.approx(tensor_bytes, rel=0.01)  # (+ rotary's buffers)
    assert outputs["gguf"] == outputs["none"]
