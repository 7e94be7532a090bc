"""The model-side `Attention` layer's part in per-layer features: its sinks parameter (loaded, narrowed per
tensor-parallel rank, handed to the backend) and backends without the `sinks` argument."""

import torch

from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.core.attention import AttentionSpec
from pagellm.distributed import Group, Parallel
from pagellm.models.context import ModelInit, set_forward_context
from pagellm.models.layers.attention import Attention
from pagellm.models.loader import copy_weights
from pagellm.testing.attention import make_paged_batch, reference_attention


def _layer(spec: AttentionSpec, backend=TorchSDPABackend, parallel: Parallel | None = None) -> Attention:
    init = ModelInit(None, spec.dtype, backend, spec.block_size, parallel=parallel or Parallel())
    return Attention(init, spec, 0)


def _run(layer: Attention, seq_lens, query_lens, compiled_op: bool = False):
    """One prefill step through the layer (eagerly, or through the op compiled graphs call); returns the
    inputs and the output."""
    s = layer.spec
    gen = torch.Generator().manual_seed(0)
    batch = make_paged_batch(seq_lens, query_lens, s.block_size, generator=gen)
    tokens = batch.num_tokens
    q = torch.randn(tokens, s.num_heads * s.head_size, generator=gen)
    k, v = (torch.randn(tokens, s.num_kv_heads * s.head_size, generator=gen) for _ in range(2))
    num_blocks = int(batch.block_tables.max()) + 1
    kv_cache = torch.zeros(layer.impl.kv_cache_shape(num_blocks, s.block_size, s.num_kv_heads, s.head_size))
    with set_forward_context(layer.impl.build_metadata(batch), [kv_cache], [layer]):
        out = torch.ops.pagellm.attention(q, k, v, torch.tensor(0)) if compiled_op else layer(q, k, v)
    shape = (-1, s.num_heads, s.head_size), (-1, s.num_kv_heads, s.head_size)
    return q.view(shape[0]), k.view(shape[1]), v.view(shape[1]), out.view(shape[0])


def test_sinks_are_a_float32_parameter_loaded_and_handed_to_the_backend():
    spec = AttentionSpec(8, 2, 16, torch.float32, has_sinks=True)
    layer = _layer(spec)
    assert [(n, p.dtype, tuple(p.shape)) for n, p in layer.named_parameters()] == [
        ("sinks", torch.float32, (8,))
    ]
    sinks = torch.randn(8).bfloat16() * 3  # as checkpoints keep them
    copy_weights(layer, [("sinks", sinks)])
    assert torch.equal(layer.sinks, sinks.float())
    for compiled_op in (False, True):
        q, k, v, out = _run(layer, [13, 6], [13, 6], compiled_op)
        expected = reference_attention(q, k, v, [13, 6], [13, 6], sinks=sinks.float())
        torch.testing.assert_close(out, expected)
    plain = _layer(AttentionSpec(8, 2, 16, torch.float32))
    assert plain.sinks is None and list(plain.parameters()) == []


def test_a_tensor_parallel_rank_loads_its_heads_sinks():
    spec = AttentionSpec(4, 1, 16, torch.float32, has_sinks=True)  # this rank's share of 8 heads
    layer = _layer(spec, parallel=Parallel(tp=Group(size=2, rank=1, ranks=[0, 1])))
    sinks = torch.arange(8, dtype=torch.float32)
    copy_weights(layer, [("sinks", sinks)])
    assert layer.sinks.tolist() == [4.0, 5.0, 6.0, 7.0]


def test_backends_without_the_sinks_argument_run_other_specs():
    """A backend written before sinks (forward without the argument) still runs every spec without them."""

    class Older(TorchSDPABackend):
        name = "OLDER"
        supports_sinks = False

        def forward(self, q, k, v, kv_cache, metadata):
            return super().forward(q, k, v, kv_cache, metadata)

    spec = AttentionSpec(4, 2, 16, torch.float32, sliding_window=5, logits_soft_cap=3.0)
    q, k, v, out = _run(_layer(spec, Older), [9], [9])
    torch.testing.assert_close(out, reference_attention(q, k, v, [9], [9], 5, logits_soft_cap=3.0))
