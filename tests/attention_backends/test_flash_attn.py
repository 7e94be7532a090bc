"""FLASH_ATTN without a GPU: its compatibility rules with faked facts, and its call into flash-attn checked
against the reference through a stand-in `flash_attn` module that follows flash-attn's documented
semantics (causal aligned to the end of each sequence, window (left, right), paged K/V via block_table)."""

import importlib.metadata
import sys
import types

import pytest
import torch

from pagellm.attention_backends import flash_attn
from pagellm.attention_backends.flash_attn import FlashAttnBackend
from pagellm.core.attention import AttentionSpec
from pagellm.core.platform import Platform
from pagellm.testing.attention import check_backend

GOOD = AttentionSpec(32, 8, 128, torch.bfloat16, block_size=256, sliding_window=4096, logits_soft_cap=30.0)


def _platform(name="cuda", device_type="cuda", capability=(9, 0)):
    return type(
        "Fake",
        (Platform,),
        {
            "name": name,
            "device_type": device_type,
            "device_capability": classmethod(lambda cls, index=0: capability),
        },
    )


@pytest.fixture
def version(monkeypatch):
    """Set the installed flash-attn version (None: not installed)."""

    def set_version(text):
        def fake(name):
            if name == "flash-attn" and text is not None:
                return text
            raise importlib.metadata.PackageNotFoundError(name)

        monkeypatch.setattr(importlib.metadata, "version", fake)

    return set_version


def test_compatible_on_ampere_and_hopper(version):
    version("2.7.4.post1")
    for capability in [(8, 0), (8, 6), (8, 9), (9, 0)]:
        assert FlashAttnBackend.unsupported_reasons(GOOD, _platform(capability=capability)) == []


def test_no_sinks(version):
    """flash-attn 2 takes a window and a soft-cap, not sink logits: such layers go to another backend."""
    version("2.8.3")
    spec = AttentionSpec(64, 8, 64, torch.bfloat16, block_size=256, sliding_window=128, has_sinks=True)
    assert FlashAttnBackend.unsupported_reasons(spec, _platform()) == ["no attention-sink support"]


def test_package_missing_or_old(version):
    version(None)
    assert FlashAttnBackend.unsupported_reasons(GOOD, _platform()) == [
        "the flash-attn package is not installed (pip install flash-attn)"
    ]
    version("2.5.9+cu122")
    assert FlashAttnBackend.unsupported_reasons(GOOD, _platform()) == [
        "flash-attn 2.5.9 is too old: paged KV in flash_attn_varlen_func needs 2.6+"
    ]


def test_device_and_capability(version):
    version("2.7.0")
    assert FlashAttnBackend.unsupported_reasons(GOOD, _platform("cpu", "cpu", None)) == [
        "runs on device types cuda, not cpu"
    ]
    for capability in [(7, 5), (10, 0), (12, 0)]:
        shown = ".".join(map(str, capability))
        assert FlashAttnBackend.unsupported_reasons(GOOD, _platform(capability=capability)) == [
            f"compute capability {shown}; flash-attn 2 runs on 8.x and 9.0"
        ]
    assert FlashAttnBackend.unsupported_reasons(GOOD, _platform("rocm", "cuda", (9, 4))) == [
        "flash-attn's ROCm build has other limits and is not wired up here"
    ]


def test_dtypes_head_sizes_and_block_sizes(version):
    version("2.7.0")
    cuda = _platform()
    bad = AttentionSpec(8, 2, 260, torch.float32, block_size=16, kv_cache_dtype=torch.float16)
    assert FlashAttnBackend.unsupported_reasons(bad, cuda) == [
        "dtype float32 not in float16, bfloat16",
        "the KV cache must have the compute dtype",
        "head size 260: needs a multiple of 8, at most 256",
        "block size 16: flash-attn reads a paged cache only in blocks of a multiple of 256 tokens (--block-size 256)",
    ]
    assert (
        FlashAttnBackend.unsupported_reasons(AttentionSpec(8, 2, 72, torch.float16, block_size=512), cuda)
        == []
    )
    assert FlashAttnBackend.unsupported_reasons(
        AttentionSpec(8, 2, 100, torch.float16, block_size=256), cuda
    ) == ["head size 100: needs a multiple of 8, at most 256"]


def _varlen_reference(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window_size,
    softcap,
    block_table,
):
    """flash_attn_varlen_func's semantics in plain torch, paged K/V included."""
    assert causal and k.shape[1] % 256 == 0 and block_table.dtype == torch.int32
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[2]
    left, right = window_size[0], 0  # causal=True sets the right window to 0
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        seq_len = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
        blocks = block_table[i, : -(-seq_len // k.shape[1])].long()
        keys = k[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        values = v[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), keys) * softmax_scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        diff = torch.arange(seq_len - (qe - qs), seq_len)[:, None] - torch.arange(seq_len)[None, :]
        hidden = diff < -right
        if left >= 0:
            hidden |= diff > left
        scores = scores.masked_fill(hidden, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out


@pytest.mark.parametrize("sliding_window, soft_cap", [(None, None), (20, None), (None, 5.0)])
def test_forward_calls_flash_attn_as_documented(monkeypatch, sliding_window, soft_cap):
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = _varlen_reference
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    spec = AttentionSpec(
        8, 2, 64, torch.bfloat16, block_size=256, sliding_window=sliding_window, logits_soft_cap=soft_cap
    )
    cases = [([300, 17, 5], [300, 17, 5]), ([300, 40, 5, 600], [20, 17, 1, 1])]
    assert check_backend(FlashAttnBackend, spec, "cpu", cases) < 3e-2


def test_plugin_registers_without_flash_attn_installed():
    assert flash_attn.PAGELLM_PLUGIN_API == "1.0"
    assert flash_attn.pagellm_attention_backends() == [FlashAttnBackend]
