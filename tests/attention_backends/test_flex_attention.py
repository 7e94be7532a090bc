import importlib.util

import pytest
import torch

from pagellm.attention_backends import flex_attention
from pagellm.attention_backends.flex_attention import FlexAttentionBackend
from pagellm.core.attention import AttentionSpec
from pagellm.core.platform import Platform
from pagellm.plugins import load_plugins
from pagellm.testing.attention import blocks_needed, check_backend, make_paged_batch

# (seq_lens, query_lens): prefill, chunked prefill, decode batch, mixed steps
CASES = [
    ([40, 33], [8, 17]),
    ([15, 16, 17, 70, 1], [1] * 5),
    ([40, 17, 5, 33], [8, 1, 1, 17]),
    ([5, 40, 6, 64], [1, 8, 1, 64]),
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


class _CPU(Platform):
    name = "testcpu"
    device_type = "cpu"


class _TPU(Platform):
    name = "testtpu"
    device_type = "xla"


@pytest.mark.parametrize("heads, block_size", [((8, 2), 16), ((4, 4), 32)], ids=["gqa-16", "mha-32"])
def test_matches_reference(heads, block_size):
    spec = AttentionSpec(*heads, head_size=32, dtype=torch.float32, block_size=block_size)
    assert check_backend(FlexAttentionBackend, spec, "cpu", CASES) < 1e-5


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("sliding_window", [None, 7, 20])
def test_dtypes_and_sliding_window(dtype, sliding_window):
    spec = AttentionSpec(9, 3, 64, dtype, block_size=16, sliding_window=sliding_window)
    assert check_backend(FlexAttentionBackend, spec, "cpu", CASES) < TOLERANCE[dtype]


def test_logits_soft_cap():
    spec = AttentionSpec(8, 2, 32, torch.float32, sliding_window=9, logits_soft_cap=5.0)
    assert check_backend(FlexAttentionBackend, spec, "cpu", CASES) < 1e-5


def test_block_masks_are_built_once_per_step():
    spec = AttentionSpec(4, 2, 32, torch.float32)
    batch = make_paged_batch([40, 17, 5], [8, 17, 1], 16)
    metadata = FlexAttentionBackend.build_metadata(batch)
    kv_cache = torch.zeros(FlexAttentionBackend.kv_cache_shape(blocks_needed([40, 17, 5], 16), 16, 2, 32))
    q, k = torch.randn(26, 4, 32), torch.randn(26, 2, 32)
    layers = [FlexAttentionBackend(spec) for _ in range(3)]
    layers[0].forward(q, k, k, kv_cache, metadata)
    masks = {key: value[1] for key, value in metadata.block_masks.items()}
    assert len(masks) == 3  # the chunk over cached context, the fresh prefill (causal), the decode
    for layer in layers[1:]:
        layer.forward(q, k, k, kv_cache, metadata)
    assert {key: value[1] for key, value in metadata.block_masks.items()} == masks


def test_unsupported_reasons(monkeypatch):
    spec = AttentionSpec(8, 2, 64, torch.bfloat16, sliding_window=4096, logits_soft_cap=30.0)
    assert FlexAttentionBackend.unsupported_reasons(spec, _CPU) == []
    assert FlexAttentionBackend.unsupported_reasons(spec, _TPU) == [
        "runs on device types cpu, cuda, xpu, not xla"
    ]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == flex_attention.FLEX_MODULE else real_find_spec(name, *a),
    )
    assert FlexAttentionBackend.unsupported_reasons(spec, _CPU) == [
        f"torch {torch.__version__} has no flex_attention (needs torch >= 2.5)"
    ]


def test_plugin_registration(monkeypatch):
    assert flex_attention.PAGELLM_PLUGIN_API == "1.0"
    monkeypatch.setenv("PAGELLM_PLUGINS", "flex_attention")
    assert load_plugins().attention_backends == {"FLEX_ATTENTION": FlexAttentionBackend}
