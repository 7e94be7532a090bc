"""AWQ and GPTQ weights as GGUF blocks for the CPU kernel (`quantization.int_blocks`): the blocks, read by
gguf-py's own decoder, hold the checkpoint's weights (exactly for Q4_0 and Q8_0, within the float16
offset's rounding for Q4_1); act-order becomes an input permutation; layouts no block holds say why."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from quant_formats import awq_quantizer, gptq_quantizer  # noqa: E402

from pagellm.platforms import cpu_gguf  # noqa: E402
from pagellm.quantization import int_blocks  # noqa: E402
from pagellm.quantization.awq import unpack_awq  # noqa: E402
from pagellm.quantization.packed import unpack  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="the CPU kernels are not built here")


def _weight(out_features: int = 96, in_features: int = 256) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))


def _gptq_blocks(bits: int, group: int, desc_act: bool, sym: bool):
    saved, deq = gptq_quantizer(bits, group, desc_act=desc_act, v2=True, sym=sym)(_weight())
    q = unpack(saved["qweight"], bits, dim=0).t()
    zeros = unpack(saved["qzeros"], bits, dim=1)
    return int_blocks.to_blocks(q, zeros, saved["scales"], saved["g_idx"], bits), deq, saved["g_idx"]


def _read_by_gguf_py(blocks: int_blocks.CpuBlocks) -> torch.Tensor:
    values = quants.dequantize(blocks.raw.numpy(), GGMLQuantizationType(blocks.type_id))
    return torch.from_numpy(np.ascontiguousarray(values))


@pytest.mark.parametrize(("bits", "expected_type"), [(4, int_blocks.Q4_0), (8, int_blocks.Q8_0)])
def test_symmetric_weights_are_blocks_of_the_same_values(bits, expected_type):
    blocks, deq, _ = _gptq_blocks(bits, 64, desc_act=False, sym=True)
    assert blocks.type_id == expected_type and blocks.perm is None
    assert blocks.raw.dtype == torch.uint8 and blocks.raw.shape == (96, 256 // 32 * {4: 18, 8: 34}[bits])
    torch.testing.assert_close(_read_by_gguf_py(blocks), deq, rtol=0, atol=0)


def test_awq_weights_are_q4_1_blocks_within_the_offsets_rounding():
    saved, deq = awq_quantizer(64)(_weight())
    q, zeros = unpack_awq(saved["qweight"]).t(), unpack_awq(saved["qzeros"])
    blocks = int_blocks.to_blocks(q, zeros, saved["scales"], torch.arange(256) // 64, 4)
    assert blocks.type_id == int_blocks.Q4_1 and blocks.raw.shape == (96, 8 * 20)
    error = (_read_by_gguf_py(blocks) - deq).abs()
    offsets = (zeros.float() * saved["scales"].float()).abs().repeat_interleave(64, dim=0).t()
    assert bool((error <= 2**-11 * offsets).all())  # half a float16 ulp of -z s, nothing else
    assert float(error.max()) > 0  # the bound is not vacuous: some offsets do round


def test_act_order_stores_inputs_sorted_by_group_and_gathers_x():
    blocks, deq, g_idx = _gptq_blocks(4, 32, desc_act=True, sym=True)
    assert blocks.perm is not None and bool((g_idx[blocks.perm][1:] >= g_idx[blocks.perm][:-1]).all())
    layer = nn.Module()
    int_blocks.install_or_say(layer, blocks, "gptq", ())
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(int_blocks.apply(layer, x), x @ deq.t(), rtol=1e-5, atol=1e-4)
    y = int_blocks.apply(layer, x.half())
    assert y.dtype == torch.float16


@pytest.mark.parametrize(
    ("bits", "group", "sym", "reason"),
    [
        (4, 16, True, "not whole blocks of 32"),
        (8, 64, False, "zero points other than 128"),
    ],
)
def test_layouts_no_block_holds_say_why(bits, group, sym, reason):
    blocks, _, _ = _gptq_blocks(bits, group, desc_act=False, sym=sym)
    assert isinstance(blocks, str) and reason in blocks
