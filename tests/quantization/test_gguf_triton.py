"""The GGUF Triton GEMM (`quantization.gguf_triton`) under the Triton interpreter on CPU tensors: for every
block type it reads, equal to x @ gguf-py's dequantized weight, alone and wired into the layers (the
"triton" path, and the dequantized matmul above MAX_TOKENS rows)."""

import sys
from pathlib import Path

import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")

TESTS = Path(__file__).parents[1]
sys.path[:0] = [str(TESTS / "models"), str(Path(__file__).parent)]
from models_harness import PagedRunner, load_pagellm  # noqa: E402
from quant_formats import k_quantize, quantized_layers, random_blocks, write_quantized  # noqa: E402
from tiny import make_tiny_checkpoint  # noqa: E402

from pagellm.platforms import cpu_gguf  # noqa: E402
from pagellm.quantization import gguf, gguf_triton, packed_triton  # noqa: E402
from pagellm.quantization.gguf_triton import TYPES, gguf_matmul  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("ggml_type", [T(t) for t in TYPES], ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_equals_x_times_the_dequantized_weight(ggml_type, tokens, dtype):
    """N=40 fills no whole 32-wide tile; K two super-blocks (K-quants) or 96 weights (three 32-weight
    blocks: a partial 64-wide tile on a device)."""
    block = GGML_QUANT_SIZES[ggml_type][0]
    columns = 512 if block == 256 else 96
    raw = random_blocks(ggml_type, 40, columns, seed=int(ggml_type), scale=0.5)
    weight = torch.from_numpy(quants.dequantize(raw, ggml_type))
    x = torch.randn(tokens, columns, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = gguf_matmul(x, torch.from_numpy(raw), int(ggml_type))
    expected = x.float() @ weight.t()
    assert got.dtype == dtype and got.shape == (tokens, 40)
    scale = expected.abs().max()
    torch.testing.assert_close(got.float() / scale, expected / scale, rtol=0, atol=TOLERANCE[dtype])


def test_a_weight_that_does_not_fit_its_bytes_is_refused():
    with pytest.raises(ValueError, match="do not hold"):
        gguf_matmul(torch.randn(2, 64), torch.zeros(8, 10, dtype=torch.uint8), int(T.Q4_0))


def test_layers_on_a_device_with_triton_take_the_kernel_and_keep_the_files_bytes(tmp_path, monkeypatch):
    """A Q4_K/Q6_K/Q5_K/Q8_0 checkpoint loaded as on a CUDA device (the path chosen as there, the tensors on
    CPU): every part on the "triton" path as the file's bytes, the kernel called by every layer for a
    short step, the dequantized matmul for a long one, and the logits the dense path's."""
    src = make_tiny_checkpoint(
        "qwen2",
        tmp_path,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    types = iter([T.Q4_K, T.Q6_K, T.Q5_K, T.Q8_0] * 16)

    def quantize(w: torch.Tensor):
        t = next(types)
        raw = k_quantize(w, t) if t != T.Q8_0 else torch.from_numpy(quants.quantize(w.numpy(), t).copy())
        return {"qweight": raw, "qweight_type": torch.tensor(int(t))}, torch.from_numpy(
            quants.dequantize(raw.numpy(), t)
        )

    dequantized = write_quantized(src, tmp_path / "q", quantize, {"quant_method": "gguf"})
    monkeypatch.setattr(cpu_gguf, "has_kernel", lambda type_id: False)
    monkeypatch.setattr(gguf_triton, "runs", lambda type_id, device: type_id in TYPES)
    model = load_pagellm(tmp_path / "q", quant_method=gguf.GgufMethod())
    reference = load_pagellm(dequantized)
    layers = quantized_layers(model)
    for layer in layers.values():
        assert layer.gguf_paths == ["triton"] * len(layer.output_sizes)
        assert all(
            getattr(layer, f"qweight_{i}").dtype == torch.uint8 for i in range(len(layer.output_sizes))
        )
    calls = []
    monkeypatch.setattr(gguf_triton, "gguf_matmul", lambda *a: calls.append(1) or gguf_matmul(*a))
    for ids in (list(range(3, 20)), list(range(3, 3 + gguf_triton.MAX_TOKENS + 8))):
        calls.clear()
        got = PagedRunner(model, num_seqs=1).step({0: ids})[0]
        expected = PagedRunner(reference, num_seqs=1).step({0: ids})[0]
        parts = sum(len(layer.output_sizes) for layer in layers.values())
        assert len(calls) == (parts if len(ids) <= gguf_triton.MAX_TOKENS else 0)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tile", packed_triton.DEVICE_TILES, ids=lambda t: "x".join(map(str, t[:3])))
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q6_K], ids=lambda t: t.name)
def test_every_device_tile_computes_the_product(tile, ggml_type, fresh_kernels, monkeypatch):
    """The tiles a device autotunes over, run by the interpreter: K tiles wider than a 32-weight block and
    narrower than a 256-weight one, and partial ones (96 weights in 64- and 128-wide tiles)."""
    monkeypatch.setattr(packed_triton, "INTERPRETER_TILE", tile)
    columns = 512 if ggml_type == T.Q6_K else 96
    raw = random_blocks(ggml_type, 40, columns, seed=1, scale=0.5)
    x = torch.randn(5, columns, generator=torch.Generator().manual_seed(1))
    expected = x @ torch.from_numpy(quants.dequantize(raw, ggml_type)).t()
    got = gguf_matmul(x, torch.from_numpy(raw), int(ggml_type))
    scale = expected.abs().max()
    torch.testing.assert_close(got / scale, expected / scale, rtol=0, atol=1e-5)
