"""`--quantization gguf` on mixtures of experts: a tiny GGUF file whose stacked experts are K-quants, as
llama.cpp's Q4_K_M writes them (Q4_K gate and up, Q6_K down), keeps them as the file's bytes on CPU
(`pagellm::gguf_moe`): the experts take exactly the file's expert tensor bytes, and the greedy tokens are
those of the same file with its experts dequantized at load (float32: equal; bfloat16, where the kernel
quantizes the activations to int8 groups: the logprob drift reported and bounded by bfloat16's own). A
layer with a type the kernel does not read is dequantized at load, as before."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, quants
from parity import GGUF_FAMILIES, mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.bench.experts import experts_of_model
from pagellm.bench.gguf_convert import convert_hf_checkpoint, reencode_gguf
from pagellm.models.layers.fused_moe.layer import FusedMoE
from pagellm.platforms import cpu_gguf

sys.path.insert(0, str(Path(__file__).parents[1] / "quantization"))
from quant_formats import k_quantize, random_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="the native CPU kernels are not built here")

WIDE = dict(
    hidden_size=256, moe_intermediate_size=256, intermediate_size=256, shared_expert_intermediate_size=256
)
"""K-quant blocks hold 256 weights: the hidden and expert widths are one block."""
Q4_K_M = {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_K, "ffn_down_exps": T.Q6_K}
ENGINE = dict(max_model_len=400, kv_cache_space=0.01)
MAX_TOKENS = 8


def expert_encoder(types: dict[str, T]):
    """`reencode_gguf`'s `encode`: each stacked expert tensor [E, rows, columns] in its type of `types`
    (Q4_K, Q5_K and Q6_K by `k_quantize`, Q2_K, Q3_K and the IQ types as random blocks: gguf-py writes none
    of them; the 32-weight block types by gguf-py), the rest left as it is."""

    def encode(name: str, values: np.ndarray):
        kind = name.split(".")[2] if name.startswith("blk.") else None
        if kind not in types:
            return None
        experts, rows, columns = values.shape
        if types[kind] in (T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.TQ2_0):
            raw = random_blocks(types[kind], experts * rows, columns, scale=0.002)
        elif types[kind] not in (T.Q4_K, T.Q5_K, T.Q6_K):  # gguf-py writes the 32-weight block types
            raw = quants.quantize(values.reshape(experts * rows, columns).astype(np.float32), types[kind])
        else:
            raw = k_quantize(
                torch.from_numpy(values.reshape(experts * rows, columns).copy()), types[kind]
            ).numpy()
        return raw.reshape(experts, rows, -1), types[kind]

    return encode


def moe_gguf(root: Path, family: str, types: dict[str, T]) -> Path:
    checkpoint = make_tiny_checkpoint(family.split("-")[0], root, **GGUF_FAMILIES[family], **WIDE)
    f32 = convert_hf_checkpoint(checkpoint, root / f"tiny-{family}.f32.gguf", "float32")
    return reencode_gguf(f32, root / f"tiny-{family}.experts.gguf", "float32", expert_encoder(types))


@pytest.fixture(scope="module")
def qwen3_moe_q4_k_m(tmp_path_factory) -> Path:
    return moe_gguf(tmp_path_factory.mktemp("gguf-moe"), "qwen3_moe", Q4_K_M)


def greedy(llm: LLM, seed: int = 3) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(300, seed=seed)[8:14]]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def expert_layers(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]


def expert_tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors if t.name.endswith("_exps.weight"))


def check_packed_tokens(path: Path) -> None:
    dequantized = greedy(LLM(str(path), dtype="float32", quantization="none", **ENGINE))
    llm = LLM(str(path), dtype="float32", quantization="gguf", **ENGINE)
    layers = expert_layers(llm)
    assert layers and all(
        layer.packed.description.startswith("native CPU kernel on GGUF blocks") for layer in layers
    )
    assert all(layer.w13 is None and layer.w2 is None for layer in layers)  # no widened copy kept
    # the file's expert bytes, as buffers the model's weight bytes count
    packed = sum(b.numel() for layer in layers for b in layer.buffers() if b.dtype == torch.uint8)
    assert packed == expert_tensor_bytes(path)
    # ... and those buffers are what the kernel reads: no second copy (the file's order beside an
    # interleaved one) stays alive
    for layer in layers:
        assert all(any(b is t for b in layer.buffers()) for t in layer.packed.run.blocks)
    experts = experts_of_model(llm.engine.runner.model)  # what the benchmark floor reads per expert
    assert experts.bytes * experts.num_experts * experts.layers == packed
    assert greedy(llm) == dequantized


def test_k_quant_experts_stay_packed_and_give_the_dequantized_tokens(qwen3_moe_q4_k_m):
    check_packed_tokens(qwen3_moe_q4_k_m)


@pytest.mark.parametrize("family", ["qwen2_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_other_families_k_quant_experts(family, tmp_path):
    """Qwen2-MoE (with its shared expert, a dense GGUF linear) and Mixtral (a `llama` file)."""
    check_packed_tokens(moe_gguf(tmp_path, family, Q4_K_M))


def test_two_and_three_bit_k_quant_experts_stay_packed(tmp_path):
    """Q3_K_M and Q2_K files keep experts in Q3_K and Q2_K (a scale and an offset per 16 weights)."""
    types = {"ffn_gate_exps": T.Q3_K, "ffn_up_exps": T.Q2_K, "ffn_down_exps": T.Q3_K}
    check_packed_tokens(moe_gguf(tmp_path, "qwen3_moe", types))


def test_iq4_experts_stay_packed(tmp_path):
    """IQ4_XS and IQ4_NL files (a 16-value grid per nibble, signed codes) keep their experts too."""
    types = {"ffn_gate_exps": T.IQ4_XS, "ffn_up_exps": T.IQ4_NL, "ffn_down_exps": T.IQ4_XS}
    check_packed_tokens(moe_gguf(tmp_path, "qwen3_moe", types))


def test_interleaved_block_types_keep_one_copy(tmp_path):
    """Q8_0, Q5_0 and Q4_0 experts are interleaved when they load (`cpu_gguf.interleave`: a new tensor);
    the layer keeps that one, not the file's beside it."""
    types = {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q5_0, "ffn_down_exps": T.Q4_0}
    check_packed_tokens(moe_gguf(tmp_path, "qwen3_moe", types))


def test_bfloat16_packed_experts_stay_close_to_the_dequantized_model(qwen3_moe_q4_k_m):
    """bfloat16 runs quantize x and the activations to int8 groups for the experts (as llama.cpp does):
    the top-8 logprobs' drift from the float32 run on the dequantized experts, reported, against the
    bfloat16 run's own."""
    prompt = {"prompt_token_ids": list(range(5, 40))}
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=8)
    logprobs = {}
    for name, dtype, quantization in [
        ("float32", "float32", None),
        ("gguf", "bfloat16", "gguf"),
        ("bf16", "bfloat16", None),
    ]:
        llm = LLM(str(qwen3_moe_q4_k_m), dtype=dtype, quantization=quantization, **ENGINE)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        logprobs[name] = {t: lp.logprob for t, lp in out.logprobs[0].items()}
        del llm
    reference = logprobs.pop("float32")
    errors = {
        name: max(abs(lp - reference[t]) for t, lp in lps.items() if t in reference)
        for name, lps in logprobs.items()
    }
    print(f"top-8 logprob drift from float32: packed experts {errors['gguf']:.4f}, bf16 {errors['bf16']:.4f}")
    assert errors["gguf"] < max(4 * errors["bf16"], 0.05)


def test_a_layer_with_a_type_without_kernel_is_dequantized_at_load(tmp_path, caplog, monkeypatch):
    from pagellm.quantization import gguf

    monkeypatch.setattr(gguf, "_dense_types_logged", set())  # said once a process: here, for this test
    path = moe_gguf(tmp_path, "qwen3_moe", {**Q4_K_M, "ffn_down_exps": T.TQ2_0})
    dequantized = greedy(LLM(str(path), dtype="float32", quantization="none", **ENGINE))
    with caplog.at_level("INFO", logger="pagellm"):
        llm = LLM(str(path), dtype="float32", quantization="gguf", **ENGINE)
    assert "TQ2_0 weights have no in-place kernel" in caplog.text
    layers = expert_layers(llm)
    assert all("GGUF" not in layer.packed.description for layer in layers)
    assert greedy(llm) == dequantized
