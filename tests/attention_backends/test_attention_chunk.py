"""Chunked local attention (`AttentionSpec.attention_chunk`, Llama 4) in the backends that claim it, against
`reference_attention`'s dense mask of transformers' rule (a query at q sees key k when k <= q and
k // chunk == q // chunk): prefills over their own keys, chunks over cached context that starts mid-chunk,
decodes on both sides of a chunk boundary, in one step and over block sizes that do and do not divide the
chunk. The conformance suite (pagellm.testing.conformance) runs the same feature cases for any backend;
backends that cannot run it are refused with the reason."""

from __future__ import annotations

import pytest
import torch

from pagellm.attention_backends.cpu_attn import CpuAttnBackend
from pagellm.attention_backends.flash_attn import FlashAttnBackend
from pagellm.attention_backends.flex_attention import FlexAttentionBackend
from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.attention_backends.triton_attn import TritonAttnBackend
from pagellm.core.attention import AttentionSpec
from pagellm.platforms.cpu import CpuPlatform
from pagellm.testing.attention import check_backend, check_layers, reference_attention

CASES = [
    ((70,), (70,)),  # one prefill over three chunks of 32
    ((70, 40), (30, 9)),  # chunks over cached context: 40..69 crosses 64; 31..39 crosses 32
    ((32, 33, 64, 65, 100), (1, 1, 1, 1, 1)),  # decodes at the last and first positions of chunks
    ((70, 33, 5, 96), (30, 1, 1, 40)),  # prefill chunks and decodes in one step
]


@pytest.mark.parametrize(
    "backend", [TorchSDPABackend, CpuAttnBackend, pytest.param(FlexAttentionBackend, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("block_size,chunk", [(16, 32), (16, 20), (4, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_attention_matches_the_reference(backend, block_size, chunk, dtype):
    spec = AttentionSpec(8, 2, 32, dtype, block_size=block_size, attention_chunk=chunk)
    assert not backend.unsupported_reasons(spec, CpuPlatform)
    error = check_backend(backend, spec, "cpu", CASES)
    assert error <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("backend", [TorchSDPABackend, CpuAttnBackend])
def test_chunked_layers_beside_full_and_windowed_ones_in_one_step(backend):
    full = AttentionSpec(8, 2, 32, torch.float32)
    layers = [AttentionSpec(8, 2, 32, torch.float32, attention_chunk=32), full]
    layers.append(AttentionSpec(8, 2, 32, torch.float32, sliding_window=32))
    assert max(check_layers(backend, layers, "cpu", CASES)) <= 1e-5


def test_the_reference_mask_is_not_a_window():
    """The chunk restarts at its boundary: the decode at 64 sees itself only, a window of 32 sees 33..64."""
    q, k = torch.randn(1, 1, 8), torch.randn(65, 1, 8)
    v = torch.arange(65, dtype=torch.float32)[:, None, None].expand(65, 1, 8)
    chunked = reference_attention(q, k, v, [1], [65], attention_chunk=32)
    assert torch.allclose(chunked, torch.full_like(chunked, 64.0))
    windowed = reference_attention(q, k, v, [1], [65], sliding_window=32)
    assert windowed.min() < 64.0


def test_backends_without_chunks_are_refused_with_the_reason():
    spec = AttentionSpec(8, 2, 64, torch.float16, attention_chunk=32)
    for backend in (TritonAttnBackend, FlashAttnBackend):
        assert "no chunked local attention" in backend.unsupported_reasons(spec, CpuPlatform)
    invariant = AttentionSpec(8, 2, 64, torch.float32, attention_chunk=32, batch_invariant=True)
    assert any(
        "chunked local attention" in r for r in CpuAttnBackend.unsupported_reasons(invariant, CpuPlatform)
    )
    assert CpuAttnBackend(spec).kernel is None  # the native kernel has windows, not chunks: the PyTorch path
    with pytest.raises(ValueError, match="does not combine"):
        AttentionSpec(8, 2, 64, torch.float32, attention_chunk=32, sliding_window=16)


def test_only_the_queries_chunks_are_gathered():
    """Decodes at positions 299, 289, 96 and 39 with chunks of 32 (blocks of 16) read from 288, 288, 96 and
    32: one block each, where a window of 32 would read two or three; a chunk over cached context (64..69)
    reads from its first query's chunk start."""
    from pagellm.core.synthetic import make_paged_batch

    spec = AttentionSpec(8, 2, 32, torch.float32, block_size=16, attention_chunk=32)
    batch = make_paged_batch([300, 290, 97, 40, 70], [1, 1, 1, 1, 6], 16)
    plan = CpuAttnBackend.build_metadata(batch).plan(spec, 16, False, 2)
    assert [g.blocks.numel() for g in plan.decodes] == [4 * 1]  # every decode's chunk lies in one block
    (prefill,) = plan.prefills
    assert prefill.blocks.numel() == 1 and prefill.mask.shape == (6, 6)  # 64..69: its chunk from 64
    sdpa = TorchSDPABackend.build_metadata(batch).plan(None, 16, False, 32)
    assert sdpa.decode.mask.shape[-1] == 12 and sdpa.prefills[0].mask.shape == (6, 6)  # 300 reads 288..299
