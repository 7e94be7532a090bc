"""`FusedMoE`: every checkpoint layout lands in the stacked layout (per-expert Qwen and Mixtral names;
GPT-OSS's fused, interleaved, transposed tensors, checked by running transformers' own experts), a rank's
shard or expert share adds up to the whole layer, and the model runner hands the experts to
`Platform.pack_moe`. What a rank reads of a checkpoint, and 2-rank parity: tests/distributed/test_moe_parallel.py."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny import make_tiny_checkpoint

from pagellm.core.errors import ConfigError
from pagellm.core.moe import SILU, SWIGLU_OAI, PackedMoE, fused_experts_reference
from pagellm.distributed import Group
from pagellm.models.layers.fused_moe.layer import FusedMoE
from pagellm.quantization.fp8 import Fp8Method
from pagellm.quantization.int8 import Int8Method

E, H, I = 4, 16, 8  # noqa: E741


def _per_expert(gen, names=("gate_proj", "up_proj", "down_proj")) -> dict[str, torch.Tensor]:
    gate, up, down = names
    out = {}
    for e in range(E):
        out[f"{e}.{gate}.weight"] = torch.randn(I, H, generator=gen)
        out[f"{e}.{up}.weight"] = torch.randn(I, H, generator=gen)
        out[f"{e}.{down}.weight"] = torch.randn(H, I, generator=gen)
    return out


def _load(layer: FusedMoE, tensors: dict[str, torch.Tensor]) -> FusedMoE:
    for name, tensor in tensors.items():
        layer.load_checkpoint(name, tensor)
    return layer


def _routing(gen, tokens: int = 12, top_k: int = 2):
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.randn(tokens, H, generator=gen), torch.rand(tokens, top_k, generator=gen), ids


@pytest.mark.parametrize(
    "names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")], ids=["qwen", "mixtral"]
)
def test_per_expert_tensors_stack_gate_then_up(names):
    gen = torch.Generator().manual_seed(0)
    tensors = _per_expert(gen, names)
    layer = _load(FusedMoE(E, H, I, torch.float32), tensors)
    gate, up, down = names
    for e in range(E):
        expected = torch.cat([tensors[f"{e}.{gate}.weight"], tensors[f"{e}.{up}.weight"]])
        assert torch.equal(layer.w13[e], expected)
        assert torch.equal(layer.w2[e], tensors[f"{e}.{down}.weight"])
    assert layer.loaded_parameters() == {"w13", "w2"}


def test_a_missing_expert_leaves_its_parameter_unfilled():
    tensors = _per_expert(torch.Generator().manual_seed(0))
    del tensors["3.up_proj.weight"]
    assert _load(FusedMoE(E, H, I, torch.float32), tensors).loaded_parameters() == {"w2"}


def test_unknown_or_misshapen_expert_tensors_are_refused():
    layer = FusedMoE(E, H, I, torch.float32)
    with pytest.raises(ConfigError, match="no counterpart"):
        layer.load_checkpoint("0.fc1.weight", torch.zeros(I, H))
    with pytest.raises(ConfigError, match="does not match"):
        layer.load_checkpoint("0.gate_proj.weight", torch.zeros(I, H + 1))


def test_gpt_oss_fused_experts_run_like_transformers():
    """GPT-OSS keeps gate_up_proj [E, H, 2I] with gate and up interleaved and multiplies x @ W: loaded,
    our reference over the stacked layout gives transformers' GptOssExperts output."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    gen = torch.Generator().manual_seed(0)
    experts = GptOssExperts(GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E))
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    layer = FusedMoE(E, H, I, torch.float32, activation=SWIGLU_OAI, bias=True)
    _load(layer, {name: param.detach() for name, param in experts.named_parameters()})
    assert layer.loaded_parameters() == {"w13", "w2", "w13_bias", "w2_bias"}
    hidden, weights, ids = _routing(gen)
    with torch.no_grad():
        expected = experts(hidden, ids, weights)
    torch.testing.assert_close(layer(hidden, weights, ids), expected, rtol=1e-5, atol=1e-4)


QUANT_METHODS = {"int8": Int8Method, "fp8": Fp8Method}


def _dequantized(layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.w13.float() * layer.w13_scale[..., None], layer.w2.float() * layer.w2_scale[..., None]


@pytest.mark.parametrize("method", list(QUANT_METHODS))
def test_quantized_experts_from_float_and_from_quantized_tensors(method):
    """Float tensors are quantized per row as they load (gate and up rows each with their own scales);
    the same values saved quantized (`weight` + `weight_scale` [rows, 1], or one per-tensor scale) load
    to the same layer; it runs the reference on its quantized weights, equal to the dequantized experts."""
    quant = QUANT_METHODS[method]
    gen = torch.Generator().manual_seed(0)
    tensors = _per_expert(gen)
    layer = _load(FusedMoE(E, H, I, torch.float32, quant_method=quant()), tensors)
    assert layer.w13.dtype == layer.w2.dtype == quant.expert_dtype
    assert layer.loaded_parameters() == {"w13", "w2", "w13_scale", "w2_scale"}
    saved = {}
    for name, tensor in tensors.items():
        values, scale = quant.quantize_rows(tensor)
        saved[name], saved[f"{name}_scale"] = values, scale[:, None]
    assert torch.equal(saved["1.up_proj.weight"].view(torch.uint8), layer.w13[1, I:].view(torch.uint8))
    again = _load(FusedMoE(E, H, I, torch.float32, quant_method=quant()), saved)
    assert again.loaded_parameters() == layer.loaded_parameters()
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        assert torch.equal(getattr(again, name).float(), getattr(layer, name).float()), name
    del saved["2.down_proj.weight_scale"]
    assert _load(FusedMoE(E, H, I, torch.float32, quant_method=quant()), saved).loaded_parameters() == {
        "w13",
        "w2",
        "w13_scale",
    }
    w13, w2 = _dequantized(layer)
    hidden, weights, ids = _routing(gen)
    torch.testing.assert_close(
        layer(hidden, weights, ids),
        fused_experts_reference(hidden, w13, w2, weights, ids),
        rtol=1e-5,
        atol=1e-5,
    )
    other = torch.float8_e4m3fn if method == "int8" else torch.int8
    with pytest.raises(ConfigError, match="quantized to"):
        FusedMoE(E, H, I, torch.float32, quant_method=quant()).load_checkpoint(
            "0.gate_proj.weight", torch.zeros(I, H, dtype=other)
        )
    per_tensor = FusedMoE(E, H, I, torch.float32, quant_method=quant())
    one = saved["0.down_proj.weight_scale"].amax()  # a per-tensor scale, as AutoFP8 writes
    per_tensor.load_checkpoint("0.down_proj.weight_scale", one)
    assert torch.equal(per_tensor.w2_scale[0], one.expand(H))


def test_quantized_experts_split_their_scales_with_their_rows():
    """Sharded by width, a rank keeps its gate and up rows' scales and all of w2's (its rows are whole);
    quantizing its own columns of w2, its w2 scales are its columns' own."""
    gen = torch.Generator().manual_seed(2)
    tensors = _per_expert(gen)
    saved = {}
    for name, tensor in tensors.items():
        saved[name], scale = Int8Method.quantize_rows(tensor)
        saved[f"{name}_scale"] = scale[:, None]
    whole = _load(FusedMoE(E, H, I, torch.float32, quant_method=Int8Method()), saved)
    half = slice(I // 2, I)
    rank = _load(FusedMoE(E, H, I, torch.float32, Group(2, 1, [0, 1]), quant_method=Int8Method()), saved)
    assert torch.equal(
        rank.w13_scale, torch.cat([whole.w13_scale[:, :I][:, half], whole.w13_scale[:, I:][:, half]], 1)
    )
    assert torch.equal(rank.w2_scale, whole.w2_scale) and torch.equal(rank.w2, whole.w2[:, :, half])
    from_float = _load(
        FusedMoE(E, H, I, torch.float32, Group(2, 1, [0, 1]), quant_method=Int8Method()), tensors
    )
    expected = torch.stack([tensors[f"{e}.down_proj.weight"][:, half].abs().amax(1) / 127 for e in range(E)])
    torch.testing.assert_close(from_float.w2_scale, expected, rtol=0, atol=0)


def test_gpt_oss_fused_experts_quantize_while_loading():
    gen = torch.Generator().manual_seed(3)
    tensors = _gpt_oss_tensors(gen)
    plain = _load(FusedMoE(E, H, I, torch.float32, activation=SWIGLU_OAI, bias=True), tensors)
    layer = FusedMoE(E, H, I, torch.float32, activation=SWIGLU_OAI, bias=True, quant_method=Int8Method())
    _load(layer, tensors)
    assert layer.loaded_parameters() == {"w13", "w2", "w13_bias", "w2_bias", "w13_scale", "w2_scale"}
    w13, w2 = _dequantized(layer)
    torch.testing.assert_close(w13, plain.w13, rtol=0, atol=float(plain.w13.abs().max()) / 254)
    hidden, weights, ids = _routing(gen)
    expected = fused_experts_reference(
        hidden, w13, w2, weights, ids, activation=SWIGLU_OAI, w13_bias=plain.w13_bias, w2_bias=plain.w2_bias
    )
    torch.testing.assert_close(layer(hidden, weights, ids), expected, rtol=1e-5, atol=1e-4)


def _two_ranks(expert_parallel: bool, bias: bool, tensors: dict[str, torch.Tensor]) -> list[FusedMoE]:
    activation = SWIGLU_OAI if bias else SILU
    return [
        _load(
            FusedMoE(E, H, I, torch.float32, Group(2, rank, [0, 1]), expert_parallel, activation, bias),
            tensors,
        )
        for rank in range(2)
    ]


def _gpt_oss_tensors(gen) -> dict[str, torch.Tensor]:
    return {
        "gate_up_proj": torch.randn(E, H, 2 * I, generator=gen),
        "gate_up_proj_bias": torch.randn(E, 2 * I, generator=gen),
        "down_proj": torch.randn(E, I, H, generator=gen),
        "down_proj_bias": torch.randn(E, H, generator=gen),
    }


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sharded", "expert-parallel"])
@pytest.mark.parametrize("layout", ["per-expert", "gpt-oss-fused"])
def test_two_ranks_add_up_to_the_whole_layer(expert_parallel, layout):
    gen = torch.Generator().manual_seed(1)
    bias = layout == "gpt-oss-fused"
    tensors = _gpt_oss_tensors(gen) if bias else _per_expert(gen)
    whole = _load(
        FusedMoE(E, H, I, torch.float32, activation=SWIGLU_OAI if bias else SILU, bias=bias), tensors
    )
    ranks = _two_ranks(expert_parallel, bias, tensors)
    for rank, layer in enumerate(ranks):
        assert layer.loaded_parameters() == whole.loaded_parameters()
        if expert_parallel:  # experts 2r, 2r + 1 whole
            assert torch.equal(layer.w13, whole.w13[2 * rank : 2 * rank + 2])
            assert torch.equal(layer.w2, whole.w2[2 * rank : 2 * rank + 2])
        else:  # its half of every expert's gate rows, of its up rows and of its down columns
            half = slice(rank * I // 2, (rank + 1) * I // 2)
            torch.testing.assert_close(
                layer.w13, torch.cat([whole.w13[:, :I][:, half], whole.w13[:, I:][:, half]], 1)
            )
            torch.testing.assert_close(layer.w2, whole.w2[:, :, half])
    hidden, weights, ids = _routing(gen, tokens=16)
    ids[0] = torch.tensor([0, 1])  # a token whose experts are all on rank 0
    total = ranks[0](hidden, weights, ids) + ranks[1](hidden, weights, ids)
    torch.testing.assert_close(total, whole(hidden, weights, ids), rtol=1e-5, atol=1e-4)


def test_splits_that_do_not_divide_are_refused():
    with pytest.raises(ConfigError, match="experts do not divide") as info:
        FusedMoE(3, H, I, torch.float32, Group(2, 0, [0, 1]), expert_parallel=True)
    assert info.value.param == "enable_expert_parallel"
    with pytest.raises(ConfigError, match="width 9 does not divide") as info:
        FusedMoE(E, H, 9, torch.float32, Group(2, 0, [0, 1]))
    assert info.value.param == "tensor_parallel_size"


def test_the_runner_hands_the_experts_to_the_platform(tmp_path, monkeypatch, caplog):
    from pagellm import LLM, SamplingParams
    from pagellm.platforms.cpu import CpuPlatform

    calls = []

    def pack_moe(cls, w13, w2, w13_bias, w2_bias, activation, w13_scale=None, w2_scale=None):
        calls.append((tuple(w13.shape), tuple(w2.shape), activation))

        def run(hidden, topk_weights, topk_ids):
            calls.append("run")
            return fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids, activation=activation)

        return PackedMoE(run, "a test kernel")

    monkeypatch.setattr(CpuPlatform, "pack_moe", classmethod(pack_moe))
    path = make_tiny_checkpoint("mixtral", tmp_path)
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = LLM(str(path), dtype="float32", num_kv_blocks=16, max_model_len=64, enforce_eager=True)
    assert calls == [((8, 64, 64), (8, 64, 32), SILU)] * 2
    assert "MoE experts of 2 layers run on a test kernel" in caplog.text
    layer = llm.engine.runner.model.model.layers[0].mlp.experts
    assert layer.w13 is None and layer.w2 is None  # the plain weights are dropped for the kernel's copy
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "run" in calls


def test_without_a_kernel_the_runner_says_the_reference_runs(tmp_path, caplog):
    from pagellm import LLM

    path = make_tiny_checkpoint("qwen3_moe", tmp_path)
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = LLM(str(path), dtype="float32", num_kv_blocks=16, max_model_len=64, enforce_eager=True)
    layer = llm.engine.runner.model.model.layers[0].mlp.experts
    if layer.packed is None:  # this platform packs no experts (yet)
        assert "MoE experts of 2 layers run on the PyTorch reference" in caplog.text
        assert layer.w13 is not None
    else:
        assert f"MoE experts of 2 layers run on {layer.packed.description}" in caplog.text
