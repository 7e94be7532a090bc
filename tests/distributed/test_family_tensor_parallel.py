"""Tensor parallelism of the newer Llama-like families: a Phi-3 rank takes its rows of each part of the
checkpoint's fused q/k/v and gate/up tensors (reading only those), an OLMo 2 rank its part of the q/k norms,
which add their squares up over the ranks; under -m slow, greedy parity with transformers on 2 gloo ranks
(tensor or pipeline parallel)."""

from __future__ import annotations

import pytest
import torch
from parity import FAMILIES, assert_greedy_parity, mixed_prompts, small_kv_cache, tiny_model_and_reference
from safetensors.torch import load_file
from test_sharded_loading import load_rank
from tiny import make_tiny_checkpoint

from pagellm import LLM
from pagellm.distributed import Group, Parallel
from pagellm.models.olmo2 import Olmo2RMSNorm, ProjectionRMSNorm

TP1 = Parallel(tp=Group(size=2, rank=1, ranks=[0, 1]))  # rank 1 of 2


def test_a_phi3_rank_reads_and_keeps_its_rows_of_the_fused_tensors(tmp_path, monkeypatch):
    path = make_tiny_checkpoint("phi3", tmp_path)  # 4 heads, 2 KV heads of 16, MLP 128
    full = load_file(str(path / "model.safetensors"))
    model, whole_reads = load_rank(path, TP1, monkeypatch, "pagellm.models.phi3:Phi3ForCausalLM")
    layer = model.model.layers[1]
    qkv = full["model.layers.1.self_attn.qkv_proj.weight"]  # q 0:64, k 64:96, v 96:128
    expected = torch.cat([qkv[32:64], qkv[80:96], qkv[112:128]])
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, expected, rtol=0, atol=0)
    gate_up = full["model.layers.1.mlp.gate_up_proj.weight"]  # gate 0:128, up 128:256
    expected = torch.cat([gate_up[64:128], gate_up[192:256]])
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, expected, rtol=0, atol=0)
    assert whole_reads and all(len(shape) == 1 for shape in whole_reads)


def test_an_olmo2_rank_keeps_its_part_of_the_qk_norms(tmp_path, monkeypatch):
    path = make_tiny_checkpoint("olmo2", tmp_path)
    full = load_file(str(path / "model.safetensors"))
    model, _ = load_rank(path, TP1, monkeypatch, "pagellm.models.olmo2:Olmo2ForCausalLM")
    attn = model.model.layers[0].self_attn
    torch.testing.assert_close(attn.q_norm.weight, full["model.layers.0.self_attn.q_norm.weight"][32:])
    torch.testing.assert_close(attn.k_norm.weight, full["model.layers.0.self_attn.k_norm.weight"][16:])


class _Ranks:
    """A stand-in tensor-parallel group of one rank: its all-reduce adds the other ranks' part."""

    def __init__(self, rank: int, size: int, others: torch.Tensor):
        self.rank, self.size, self.others = rank, size, others

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + self.others


@pytest.mark.parametrize("replicated", [False, True], ids=["split", "replicated"])
def test_projection_norm_over_ranks_equals_the_whole(replicated):
    """Two ranks holding halves of a projection (or both the same single KV head) normalise as one."""
    gen = torch.Generator().manual_seed(0)
    width = 16 if replicated else 32
    x, weight = torch.randn(5, width, generator=gen), torch.randn(width, generator=gen)
    whole = Olmo2RMSNorm(width, 1e-6, torch.float32)
    whole.weight.data.copy_(weight)
    parts = [(0, 16), (0, 16)] if replicated else [(0, 16), (16, 16)]
    squares = [x[:, s : s + n].pow(2).sum(-1, keepdim=True) for s, n in parts]
    outs = []
    for rank, (start, n) in enumerate(parts):
        norm = ProjectionRMSNorm((start, n), 1e-6, torch.float32, _Ranks(rank, 2, squares[1 - rank]))
        norm.weight.data.copy_(weight[start : start + n])
        outs.append(norm(x[:, start : start + n]))
    expected = whole(x)
    torch.testing.assert_close(outs[0] if replicated else torch.cat(outs, -1), expected)
    if replicated:
        torch.testing.assert_close(outs[1], expected)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "family",
    [
        f
        for f in FAMILIES
        if f.split("-")[0] in ("phi3", "granite", "olmo2", "smollm3", "olmo3", "seed_oss", "glm4", "exaone4")
    ],
)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_greedy_parity_on_two_ranks(tmp_path, family, tp, pp):
    path, reference = tiny_model_and_reference(family, tmp_path, 12)
    llm = LLM(
        str(path),
        dtype="float32",
        enforce_eager=True,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        # 40 blocks, or as many as one request of max_model_len needs over a windowed model's KV cache groups
        num_kv_blocks=max(40, small_kv_cache(path, 512, 64, spare=2)),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )
    try:
        assert_greedy_parity(llm, reference, mixed_prompts(300)[::2])
        assert llm.engine.stats().num_preemptions > 0
    finally:
        llm.shutdown()
