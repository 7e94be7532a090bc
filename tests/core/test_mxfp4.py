"""MXFP4 dequantization against transformers' (`convert_moe_packed_tensors`, what it loads gpt-oss's
experts with when it cannot run MXFP4 kernels), over every code and a spread of scales."""

from __future__ import annotations

import pytest
import torch

from pagellm.core.mxfp4 import FP4_VALUES, dequantize_mxfp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantization_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 10, 4), generator=generator).to(torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    assert ours.shape == (3, 10, 128) and ours.dtype == dtype
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [3, 128, 10]: transposed for x @ W
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_low_nibble_first_and_the_scale_a_biased_power_of_two():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)  # one row of one block
    blocks[0, 0, 0] = 0x9F  # low nibble 15 (-6.0), high nibble 9 (-0.5)
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2^1
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out[0, :2].tolist() == [2 * FP4_VALUES[15], 2 * FP4_VALUES[9]] == [-12.0, -1.0]
    assert not out[0, 2:].any()


def test_blocks_and_scales_that_do_not_pair_up_are_refused():
    with pytest.raises(ValueError, match="do not pair up"):
        dequantize_mxfp4(
            torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), torch.float32
        )


def test_ggml_rows_hold_the_same_values_in_ggmls_block_order():
    """`ggml_rows` rewrites the checkpoint's blocks as GGML's MXFP4 blocks (type 39): gguf-py's
    dequantization of them gives the checkpoint's values, every code and scale (GGML writes
    code 8, FP4's -0.0, as +0.0: equal as values)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from pagellm.core.mxfp4 import GGML_BLOCK_BYTES, ggml_rows

    generator = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 256, 3, 16), generator=generator, dtype=torch.uint8)
    # every scale byte but 255, OCP's NaN (which the two dequantizations spell differently)
    scales = torch.arange(256, dtype=torch.uint8).clamp(max=254).repeat(2, 3, 1).transpose(1, 2).contiguous()
    rows = ggml_rows(blocks, scales)
    assert rows.shape == (2, 256, 3 * GGML_BLOCK_BYTES) and rows.dtype == torch.uint8
    theirs = quants.dequantize(rows.reshape(512, -1).numpy(), GGMLQuantizationType.MXFP4)
    ours = dequantize_mxfp4(blocks, scales, torch.float32).reshape(512, -1).numpy()
    assert np.array_equal(theirs, ours)
