"""A tensor-parallel rank reads only its part of each split checkpoint tensor (safetensors slices), and
what it holds is exactly that part; a pipeline stage reads nothing of the other stages' layers."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from tiny import make_tiny_checkpoint

from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.distributed import Group, Parallel
from pagellm.models.base import ModelInit
from pagellm.models.loader import CheckpointSlice, iter_checkpoint_weights, load_model


def load_rank(
    path, parallel: Parallel, monkeypatch, model_class: str = "pagellm.models.llama:LlamaForCausalLM"
) -> tuple[torch.nn.Module, list[torch.Size]]:
    from transformers import AutoConfig

    whole_reads = []
    original = CheckpointSlice.load
    monkeypatch.setattr(
        CheckpointSlice, "load", lambda self: whole_reads.append(self.shape) or original(self)
    )
    init = ModelInit(AutoConfig.from_pretrained(path), torch.float32, TorchSDPABackend, parallel=parallel)
    weights = iter_checkpoint_weights(path, lazy=True)
    model = load_model(model_class, init, weights, "cpu")
    return model, whole_reads


def test_a_tensor_parallel_rank_reads_and_keeps_only_its_part(tmp_path, monkeypatch):
    path = make_tiny_checkpoint("llama", tmp_path)  # 4 heads, 2 KV heads of 16, MLP 128, vocab 384
    full = load_file(str(path / "model.safetensors"))
    model, whole_reads = load_rank(path, Parallel(tp=Group(size=2, rank=1, ranks=[0, 1])), monkeypatch)
    layer = model.model.layers[0]
    q, k, v = (full[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    torch.testing.assert_close(
        layer.self_attn.qkv_proj.weight, torch.cat([q[32:], k[16:], v[16:]]), rtol=0, atol=0
    )
    o = full["model.layers.0.self_attn.o_proj.weight"]
    torch.testing.assert_close(layer.self_attn.o_proj.weight, o[:, 32:], rtol=0, atol=0)
    down = full["model.layers.0.mlp.down_proj.weight"]
    torch.testing.assert_close(layer.mlp.down_proj.weight, down[:, 64:], rtol=0, atol=0)
    embed = full["model.embed_tokens.weight"]
    torch.testing.assert_close(model.model.embed_tokens.weight, embed[192:], rtol=0, atol=0)
    # whole tensors read: only the unsplit ones (norms); every matrix was read as a slice
    assert whole_reads and all(len(shape) == 1 for shape in whole_reads)


def test_a_pipeline_stage_reads_nothing_of_the_other_stages_layers(tmp_path, monkeypatch):
    path = make_tiny_checkpoint("llama", tmp_path)  # 2 layers: stage 1 holds layer 1, the norm
    model, whole_reads = load_rank(path, Parallel(pp=Group(size=2, rank=1, ranks=[0, 1])), monkeypatch)
    assert model.model.embed_tokens is None and model.lm_head is None
    assert isinstance(model.model.layers[0], torch.nn.Identity)
    names = {name for name, _ in model.named_parameters()}
    assert names and all(n.startswith(("model.layers.1.", "model.norm.")) for n in names)
    ours = [
        n
        for n in load_file(str(path / "model.safetensors"))
        if n.startswith(("model.layers.1.", "model.norm."))
    ]
    assert len(whole_reads) == len(ours)  # one read per checkpoint tensor of its own, none of layer 0's
