"""Packing orders checked against hand-written words, the FP8 _scaled_mm path, and refusals."""

from __future__ import annotations

import pytest
import torch

from pagellm.core.errors import ConfigError
from pagellm.quantization.awq import AwqMethod, unpack_awq
from pagellm.quantization.fp8 import Fp8Method, scaled_mm_linear
from pagellm.quantization.gptq import GptqMethod
from pagellm.quantization.int8 import Int8Method
from pagellm.quantization.packed import unpack


def test_awq_unpacks_its_interleaved_column_order():
    # columns 0..7 hold values 0..7; nibble i (lowest first) holds column AWQ_ORDER[i] = 0,2,4,6,1,3,5,7
    word = torch.tensor([[0x75316420]], dtype=torch.int32)
    assert unpack_awq(word).tolist() == [list(range(8))]


def test_gptq_unpacks_sequentially_along_the_input_dimension():
    words = torch.tensor([[0x76543210, -0x01234568]], dtype=torch.int32)  # second word: 0xFEDCBA98
    assert unpack(words, 4, dim=0)[:, 0].tolist() == list(range(8))
    assert unpack(words, 4, dim=0)[:, 1].tolist() == list(range(8, 16))
    assert unpack(words, 8, dim=1).tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]


def test_fp8_scaled_mm_path_approximates_the_weight_only_result():
    torch.manual_seed(0)
    weight, x = torch.randn(32, 64), torch.randn(5, 64, dtype=torch.bfloat16)
    qweight, scale = Fp8Method.quantize(weight)
    exact = x.float() @ (qweight.float() * scale).t()
    got = scaled_mm_linear(x, qweight, scale, None)
    assert got.dtype == torch.bfloat16
    assert (got.float() - exact).abs().max() < 0.06 * exact.abs().max()


def test_refusals():
    with pytest.raises(ConfigError, match="static"):
        Fp8Method({"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(ConfigError, match="'gptq'"):
        Int8Method({"quant_method": "gptq", "bits": 4})
    with pytest.raises(ConfigError, match="3-bit"):
        GptqMethod({"quant_method": "gptq", "bits": 3})
    with pytest.raises(ConfigError, match="gemv"):
        AwqMethod({"quant_method": "awq", "version": "gemv"})
