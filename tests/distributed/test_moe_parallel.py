"""Mixture-of-experts models over 2 ranks: a rank reads and keeps only its part of the experts (its width
of every expert when sharded, its experts whole with --enable-expert-parallel), a DeepSeek rank its
attention heads with the latent path whole, splits that cannot work are refused before loading, and both
splits and the pipeline give transformers' greedy tokens on 2 gloo ranks (one family and split in the
default run, the rest under -m slow)."""

from __future__ import annotations

import pytest
import torch
from parity import assert_greedy_parity, mixed_prompts, tiny_model_and_reference
from safetensors.torch import load_file
from test_sharded_loading import load_rank
from tiny import make_tiny_checkpoint

from pagellm import LLM
from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.distributed import Group, Parallel
from pagellm.engine.setup import resolve_engine
from pagellm.models.base import ModelInit
from pagellm.models.layers.fused_moe.block import expert_count
from pagellm.models.layers.fused_moe.layer import FusedMoE
from pagellm.models.loader import CheckpointSlice, iter_checkpoint_weights, load_model

TP1 = Parallel(tp=Group(size=2, rank=1, ranks=[0, 1]))  # rank 1 of 2


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sharded", "expert-parallel"])
def test_a_rank_reads_and_keeps_only_its_part_of_the_experts(tmp_path, monkeypatch, expert_parallel):
    from transformers import AutoConfig

    path = make_tiny_checkpoint("qwen2_moe", tmp_path)  # 8 experts of width 32, shared expert 48, hidden 64
    full = load_file(str(path / "model.safetensors"))
    reads = []
    for method in ("load", "narrow"):
        original = getattr(CheckpointSlice, method)
        monkeypatch.setattr(
            CheckpointSlice,
            method,
            lambda self, *a, _o=original, _m=method: reads.append((_m, self._name)) or _o(self, *a),
        )
    original_init = CheckpointSlice.__init__

    def init(self, handle, name):
        original_init(self, handle, name)
        self._name = name

    monkeypatch.setattr(CheckpointSlice, "__init__", init)
    parallel = Parallel(tp=Group(size=2, rank=1, ranks=[0, 1]))
    model_init = ModelInit(
        AutoConfig.from_pretrained(path),
        torch.float32,
        TorchSDPABackend,
        parallel=parallel,
        expert_parallel=expert_parallel,
    )
    model = load_model(
        "pagellm.models.qwen2_moe:Qwen2MoeForCausalLM",
        model_init,
        iter_checkpoint_weights(path, lazy=True),
        "cpu",
    )
    mlp = model.model.layers[1].mlp
    experts = mlp.experts
    assert (experts.num_local_experts, experts.first_expert) == ((4, 4) if expert_parallel else (8, 0))
    cols = slice(None) if expert_parallel else slice(16, 32)
    for local in range(experts.num_local_experts):
        name = f"model.layers.1.mlp.experts.{experts.first_expert + local}"
        gate, up, down = (full[f"{name}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
        assert torch.equal(experts.w13[local], torch.cat([gate[cols], up[cols]]))
        assert torch.equal(experts.w2[local], down[:, cols])
    shared_down = full["model.layers.1.mlp.shared_expert.down_proj.weight"]
    assert torch.equal(mlp.shared_expert.down_proj.weight, shared_down[:, 24:])  # sharded either way
    expert_reads = {name for _, name in reads if ".mlp.experts." in name}
    if expert_parallel:  # nothing at all of rank 0's experts 0-3
        assert expert_reads == {n for n in full if ".mlp.experts." in n and int(n.split(".")[5]) >= 4}
    assert not any(m == "load" and ".mlp.experts." in n for m, n in reads)  # experts: slices only


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sharded", "expert-parallel"])
def test_a_rank_dequantizes_its_part_of_mxfp4_experts(tmp_path, monkeypatch, expert_parallel):
    """A split layer does not keep GPT-OSS's MXFP4 blocks (the kernel reads whole layers): each pair is
    dequantized as it arrives and the rank keeps its part, as transformers dequantizes the whole."""
    from test_gpt_oss import write_mxfp4_experts

    from pagellm.core.mxfp4 import dequantize_mxfp4

    path = make_tiny_checkpoint("gpt_oss", tmp_path)
    write_mxfp4_experts(path)
    full = load_file(str(path / "model.safetensors"))
    from transformers import AutoConfig

    init = ModelInit(
        AutoConfig.from_pretrained(path),
        torch.float32,
        TorchSDPABackend,
        parallel=TP1,
        expert_parallel=expert_parallel,
    )
    weights = iter_checkpoint_weights(path, lazy=True)
    model = load_model("pagellm.models.gpt_oss:GptOssForCausalLM", init, weights, "cpu")
    layer = next(m for m in model.modules() if isinstance(m, FusedMoE))
    assert layer.mxfp4 is None
    prefix = "model.layers.0.mlp.experts."
    gate_up = dequantize_mxfp4(
        full[prefix + "gate_up_proj_blocks"], full[prefix + "gate_up_proj_scales"], torch.float32
    )
    down = dequantize_mxfp4(
        full[prefix + "down_proj_blocks"], full[prefix + "down_proj_scales"], torch.float32
    )
    gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    if expert_parallel:
        experts = slice(layer.first_expert, layer.first_expert + layer.num_local_experts)
        expected_w13, expected_w2 = torch.cat([gate, up], 1)[experts], down[experts]
    else:
        width = slice(layer.width_start, layer.width_start + layer.width)
        expected_w13 = torch.cat([gate[:, width], up[:, width]], 1)
        expected_w2 = down[:, :, width]
    assert torch.equal(layer.w13, expected_w13) and torch.equal(layer.w2, expected_w2)


@pytest.mark.parametrize(
    "settings,overrides,message,param",
    [
        ({"enable_expert_parallel": True}, {"num_experts": 6, "num_hidden_layers": 1}, None, None),
        (
            {"enable_expert_parallel": True},
            {"num_experts": 5},
            "5 experts do not divide",
            "enable_expert_parallel",
        ),
        (
            {},
            {"moe_intermediate_size": 33},
            "moe_intermediate_size 33 does not divide",
            "tensor_parallel_size",
        ),
        ({"enable_expert_parallel": True}, {"moe_intermediate_size": 33}, None, None),
        (
            {},
            {"shared_expert_intermediate_size": 45},
            "shared_expert_intermediate_size 45",
            "tensor_parallel_size",
        ),
    ],
)
def test_expert_splits_that_cannot_work_are_refused_before_loading(
    tmp_path, settings, overrides, message, param
):
    path = make_tiny_checkpoint("qwen2_moe", tmp_path, **overrides)
    config = EngineConfig(model=str(path), tensor_parallel_size=2, attention_backend="TORCH_SDPA", **settings)
    if message is None:
        resolve_engine(config)
        return
    with pytest.raises(ConfigError, match=message) as info:
        resolve_engine(config)
    assert info.value.param == param


def test_a_deepseek_rank_keeps_its_heads_and_the_whole_latent_path(tmp_path, monkeypatch):
    """Rank 1 of 2: heads 2-3 of q (q_proj, or q_b_proj after the whole q_a_proj), of kv_b_proj and of
    o_proj's input; the latent projection and norms whole, one latent KV head of the whole width."""
    for arch, q_lora in (("deepseek_v2", False), ("deepseek_v3", True)):  # 4 heads of 16 nope + 8 rope
        path = make_tiny_checkpoint(arch, tmp_path / arch)
        full = load_file(str(path / "model.safetensors"))
        model_class = "DeepseekV3ForCausalLM" if q_lora else "DeepseekV2ForCausalLM"
        model, _ = load_rank(path, TP1, monkeypatch, f"pagellm.models.deepseek:{model_class}")
        attn = model.model.layers[1].self_attn
        name = "model.layers.1.self_attn"
        latent = full[f"{name}.kv_a_proj_with_mqa.weight"]
        if q_lora:
            a = torch.cat([full[f"{name}.q_a_proj.weight"], latent])
            assert torch.equal(attn.q_b_proj.weight, full[f"{name}.q_b_proj.weight"][48:])
        else:
            a = torch.cat([full[f"{name}.q_proj.weight"][48:], latent])
        assert torch.equal(attn.fused_qkv_a_proj.weight, a)
        v_dim = attn.v_dim
        up_rows = 2 * (16 + v_dim)  # heads 0-1's W_UK and W_UV rows: rank 0's
        up = full[f"{name}.kv_b_proj.weight"][up_rows:].view(2, -1, attn.rank)  # this rank's two heads
        nope = attn.kv_b_proj.nope
        laid_out = torch.cat([up[:, :nope].flatten(), up[:, nope:].transpose(1, 2).flatten()])
        assert torch.equal(attn.kv_b_proj.weight.flatten(), laid_out)  # W_UK per head, then W_UV^T per head
        assert torch.equal(attn.o_proj.weight, full[f"{name}.o_proj.weight"][:, 2 * v_dim :])
        assert torch.equal(attn.kv_a_layernorm.weight, full[f"{name}.kv_a_layernorm.weight"])
        spec = attn.attn.spec
        assert (spec.num_heads, spec.num_kv_heads, spec.head_size, spec.v_size) == (2, 1, 40, 32)


def test_deepseek_heads_that_do_not_divide_are_refused(tmp_path):
    path = make_tiny_checkpoint("deepseek_v3", tmp_path)
    config = EngineConfig(model=str(path), tensor_parallel_size=3, attention_backend="TORCH_SDPA")
    with pytest.raises(ConfigError, match="4 attention heads do not divide by it"):
        resolve_engine(config)


SLOW = pytest.mark.slow
SPLITS = [  # family, tensor-parallel size, pipeline-parallel size, expert parallel
    pytest.param("qwen2_moe-dense-layer", 2, 1, True, id="qwen2_moe-expert-parallel"),
    pytest.param("qwen2_moe-dense-layer", 2, 1, False, id="qwen2_moe-sharded", marks=SLOW),
    pytest.param("qwen2_moe-dense-layer", 1, 2, False, id="qwen2_moe-pipeline", marks=SLOW),
    pytest.param("qwen3_moe", 2, 1, True, id="qwen3_moe-expert-parallel", marks=SLOW),
    pytest.param("qwen3_moe", 2, 1, False, id="qwen3_moe-sharded", marks=SLOW),
    pytest.param("mixtral", 2, 1, True, id="mixtral-expert-parallel", marks=SLOW),
    pytest.param("mixtral", 2, 1, False, id="mixtral-sharded", marks=SLOW),
    pytest.param("gpt_oss", 2, 1, True, id="gpt_oss-expert-parallel", marks=SLOW),
    pytest.param("gpt_oss", 2, 1, False, id="gpt_oss-sharded", marks=SLOW),
    pytest.param("glm4_moe", 2, 1, True, id="glm4_moe-expert-parallel", marks=SLOW),
    pytest.param("glm4_moe", 2, 1, False, id="glm4_moe-sharded", marks=SLOW),
    pytest.param("olmoe", 2, 1, False, id="olmoe-sharded", marks=SLOW),  # q/k norms summed over ranks
    pytest.param("olmoe", 1, 2, False, id="olmoe-pipeline", marks=SLOW),
    # Granite MoE: the stacked expert tensors read whole, each rank keeping its part
    pytest.param("granitemoe", 2, 1, True, id="granitemoe-expert-parallel", marks=SLOW),
    pytest.param("granitemoe", 2, 1, False, id="granitemoe-sharded", marks=SLOW),
    pytest.param("ernie4_5_moe", 2, 1, True, id="ernie4_5_moe-expert-parallel", marks=SLOW),
    pytest.param("ernie4_5_moe", 2, 1, False, id="ernie4_5_moe-sharded", marks=SLOW),
    pytest.param("ernie4_5_moe", 1, 2, False, id="ernie4_5_moe-pipeline", marks=SLOW),
    pytest.param("minimax_m2", 2, 1, True, id="minimax_m2-expert-parallel", marks=SLOW),
    pytest.param("minimax_m2", 2, 1, False, id="minimax_m2-sharded", marks=SLOW),
    pytest.param("hunyuan_v1_moe", 2, 1, True, id="hunyuan_v1_moe-expert-parallel", marks=SLOW),
    pytest.param("hunyuan_v1_moe", 2, 1, False, id="hunyuan_v1_moe-sharded", marks=SLOW),
    pytest.param("hunyuan_v1_moe", 1, 2, False, id="hunyuan_v1_moe-pipeline", marks=SLOW),
    # Llama 4: chunked layers' KV split by heads, the experts run once per choice on scaled inputs
    pytest.param("llama4_text", 2, 1, True, id="llama4_text-expert-parallel", marks=SLOW),
    pytest.param("llama4_text", 2, 1, False, id="llama4_text-sharded", marks=SLOW),
    pytest.param("llama4_text", 1, 2, False, id="llama4_text-pipeline", marks=SLOW),
    # MLA: heads split, the latent KV cache whole on each rank; pipeline: the dense layer 0 on stage 0,
    # the mixture of experts on stage 1
    pytest.param("deepseek_v2", 2, 1, True, id="deepseek_v2-expert-parallel", marks=SLOW),
    pytest.param("deepseek_v2", 2, 1, False, id="deepseek_v2-sharded", marks=SLOW),
    pytest.param("deepseek_v2", 1, 2, False, id="deepseek_v2-pipeline", marks=SLOW),
    pytest.param("deepseek_v3", 2, 1, True, id="deepseek_v3-expert-parallel", marks=SLOW),
    pytest.param("deepseek_v3", 2, 1, False, id="deepseek_v3-sharded", marks=SLOW),
    pytest.param("deepseek_v3", 1, 2, False, id="deepseek_v3-pipeline", marks=SLOW),
]


KV_BLOCKS = {"llama4_text": 56}
"""Blocks for families whose 40 cannot hold one request of 512 tokens: Llama 4's 3 chunked layers are KV cache
groups of their own beside the full one (53 blocks)."""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,tp,pp,expert_parallel", SPLITS)
def test_greedy_parity_on_two_ranks(tmp_path, family, tp, pp, expert_parallel):
    from transformers import AutoConfig

    path, reference = tiny_model_and_reference(family, tmp_path, 12)
    llm = LLM(
        str(path),
        dtype="float32",
        enforce_eager=True,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        num_kv_blocks=KV_BLOCKS.get(family, 40),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        enable_expert_parallel=expert_parallel,
    )
    try:
        if tp > 1:  # (a pipeline's first stage may hold no experts: DeepSeek's layer 0 is dense)
            experts = next(m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE))
            total = expert_count(AutoConfig.from_pretrained(path))
            assert experts.num_local_experts == total // (2 if expert_parallel else 1)  # on rank 0 of 2
        assert_greedy_parity(llm, reference, mixed_prompts(300)[::2])
        assert llm.engine.stats().num_preemptions > 0
    finally:
        llm.shutdown()
