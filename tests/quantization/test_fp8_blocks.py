"""Block-wise fp8 checkpoints (DeepSeek-V3, Qwen3-*-FP8, GLM-4.5-FP8): `weight` e4m3 with `weight_scale_inv`
per block, requantized per row as they load (pagellm/quantization/fp8_blocks.py).

Tiny checkpoints are written here in that layout (`fp8_block_quantizer`) with small blocks, shapes that do
not divide by them, and layers left unquantized as `modules_to_not_convert` lists them. Two oracles, both
transformers in float32: on the checkpoint's weights as pagellm keeps them (the blocks dequantized, then
quantized per row), for greedy parity; and on the blocks dequantized (the model the checkpoint means), for
the log-prob error the second rounding costs. transformers 5 reads the format itself on CPU by dequantizing,
but derives each tensor's block size from its scale grid, wrong where a shape does not divide by the block
(48 rows in blocks of 32 come out as 2 blocks of 24), so it is the oracle only where shapes divide
(`test_transformers_reads_the_written_checkpoint_as_written`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

TESTS = Path(__file__).parents[1]
sys.path[:0] = [str(TESTS / "models"), str(TESTS / "engine"), str(Path(__file__).parent)]

from parity import Reference, assert_greedy_parity, max_logprob_error, mixed_prompts  # noqa: E402
from quant_formats import fp8_block_quantizer, is_quantized_with_experts, write_quantized  # noqa: E402
from tiny import make_tiny_checkpoint  # noqa: E402

from pagellm import LLM  # noqa: E402
from pagellm.core.errors import ConfigError  # noqa: E402
from pagellm.models.layers.fused_moe.layer import FusedMoE  # noqa: E402
from pagellm.models.layers.linear import Linear  # noqa: E402
from pagellm.quantization.fp8 import Fp8Method  # noqa: E402
from pagellm.quantization.fp8_blocks import dequantize_blocks, requantized  # noqa: E402

FP8 = torch.float8_e4m3fn
MAX_TOKENS = 8
IGNORED = "model.layers.1.self_attn"  # its q/k/v (fused in pagellm) and o stay float
LOGPROB_TOLERANCE = 1.5
"""Largest |log-prob| difference, teacher-forced along pagellm's greedy output, against the block-dequantized
model. The tiny models' wide random weights magnify weight error: the block quantization itself moves the
qwen3_moe checkpoint's log-probs by up to 0.56 against its float original; the second rounding by up to
0.98 against the blocks."""


def _config(block: list[int]) -> dict:
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": block,
        "modules_to_not_convert": ["lm_head", IGNORED],
    }


def _selected(name: str, tensor: torch.Tensor) -> bool:
    return is_quantized_with_experts(name, tensor) and not name.startswith(f"{IGNORED}.")


def write_block_checkpoint(src: Path, root: Path, block: tuple[int, int]) -> tuple[Path, Path, Path]:
    """(block-wise checkpoint, its weights as pagellm keeps them, its blocks dequantized)."""
    kept = write_quantized(
        src, root / "block", fp8_block_quantizer(block, True), _config(list(block)), _selected
    )
    meant = write_quantized(
        src, root / "meant", fp8_block_quantizer(block, False), _config(list(block)), _selected
    )
    return root / "block", kept, meant


def _engine(path: Path) -> LLM:
    return LLM(str(path), dtype="float32", num_kv_blocks=200, max_model_len=400)


def _layer(llm: LLM, name: str) -> torch.nn.Module:
    return llm.engine.runner.model.get_submodule(name)


def _stored_dtype(layer: torch.nn.Module) -> torch.dtype:
    """The dtype a linear keeps its weight in: its weight's, or its panels' where the CPU's weight-only
    panel kernel runs (they replace the weight: `channelwise.py`)."""
    return (layer.weight if layer.weight is not None else layer.panel_weight).dtype


# -- the stream translation, without a model ------------------------------------------------------------------


def test_blocks_dequantize_with_partial_edge_blocks():
    torch.manual_seed(0)
    q = (torch.randn(5, 7) * 100).to(FP8)
    scale_inv = torch.rand(3, 2) + 0.5  # blocks of 2 x 4: rows 4 and columns 4..6 partial
    expected = torch.empty(5, 7)
    for r in range(5):
        for c in range(7):
            expected[r, c] = q[r, c].float() * scale_inv[r // 2, c // 4]
    assert torch.equal(dequantize_blocks(q, scale_inv, (2, 4)), expected)
    with pytest.raises(ConfigError, match=r"\(3, 2\)"):
        dequantize_blocks(q, scale_inv[:2], (2, 4))


def test_the_stream_pairs_each_weight_with_its_block_scales():
    """Halves of a pair in either order and apart; float tensors pass; `float_modules` stay dequantized."""
    torch.manual_seed(0)
    q, scale_inv = (torch.randn(4, 6) * 50).to(FP8), torch.rand(2, 1) + 0.1
    norm, float_weight = torch.ones(6), torch.randn(4, 6)
    stream = [
        ("a.proj.weight_scale_inv", scale_inv),
        ("a.norm.weight", norm),
        ("a.proj.weight", q),
        ("b.kv_b_proj.weight", q),
        ("b.kv_b_proj.weight_scale_inv", scale_inv),
        ("c.ignored.weight", float_weight),
    ]
    out = dict(requantized(stream, (2, 6), Fp8Method.quantize, float_modules=("kv_b_proj",)))
    assert list(out) == [
        "a.norm.weight",
        "a.proj.weight",
        "a.proj.weight_scale",
        "b.kv_b_proj.weight",
        "c.ignored.weight",
    ]
    dequantized = dequantize_blocks(q, scale_inv, (2, 6))
    values, scale = Fp8Method.quantize(dequantized)
    assert out["a.proj.weight"].dtype == FP8 and torch.equal(out["a.proj.weight"].float(), values.float())
    assert torch.equal(out["a.proj.weight_scale"], scale) and scale.shape == (4, 1)
    assert torch.equal(out["b.kv_b_proj.weight"], dequantized)
    assert out["a.norm.weight"] is norm and out["c.ignored.weight"] is float_weight


@pytest.mark.parametrize(
    ("stream", "message"),
    [
        ([("x.weight", torch.zeros(2, 2, dtype=FP8))], "x.weight has no weight_scale_inv"),
        ([("x.weight_scale_inv", torch.ones(1, 1))], "x.weight_scale_inv has no e4m3 weight"),
        (
            [("x.weight", torch.zeros(2, 2, dtype=FP8)), ("x.weight_scale", torch.ones(2, 1))],
            "no weight_scale_inv",
        ),
    ],
)
def test_an_unpaired_half_is_refused(stream, message):
    with pytest.raises(ConfigError, match=message):
        list(requantized(stream, (2, 2), Fp8Method.quantize))


@pytest.mark.parametrize("block", [[128], [0, 128], [128.0, 128], "128x128"])
def test_a_malformed_block_size_is_refused(block):
    with pytest.raises(ConfigError, match="weight_block_size"):
        Fp8Method({"quant_method": "fp8", "weight_block_size": block})


def test_a_fused_layer_cannot_mix_quantized_and_float_parts():
    for first, second in (
        (torch.zeros(4, 8, dtype=FP8), torch.zeros(4, 8)),
        (torch.zeros(4, 8), torch.zeros(4, 8, dtype=FP8)),
    ):
        layer = Linear(8, 8, False, torch.float32, Fp8Method({"quant_method": "fp8"}), [4, 4])
        layer.weight.weight_loader(layer.weight, first, 0)
        with pytest.raises(ConfigError, match="mixes"):
            layer.weight.weight_loader(layer.weight, second, 1)


# -- checkpoints, end to end -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """Blocks of 32 x 32 over experts 48 wide: their gate/up rows and down columns end in half blocks."""
    root = tmp_path_factory.mktemp("fp8-blocks-moe")
    src = make_tiny_checkpoint("qwen3_moe", root, moe_intermediate_size=48)
    return (*write_block_checkpoint(src, root, (32, 32)), src)


def test_a_block_quantized_mixture_of_experts_loads(qwen3_moe):
    path, kept, _, _ = qwen3_moe
    llm = _engine(path)
    assert llm.engine.setup.quant_method.name == "fp8"
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(layer.weight_dtype == FP8 for layer in experts)
    assert _layer(llm, "model.layers.0.self_attn.qkv_proj").quant_method is not None
    for name in ("qkv_proj", "o_proj"):  # modules_to_not_convert: plain float layers
        layer = _layer(llm, f"{IGNORED}.{name}")
        assert layer.quant_method is None and not hasattr(layer, "weight_scale")
    assert_greedy_parity(llm, Reference(kept, MAX_TOKENS), mixed_prompts(300)[:3])


@pytest.mark.slow
def test_the_second_rounding_costs_a_bounded_logprob_error(qwen3_moe):
    path, _, meant, _ = qwen3_moe
    assert (
        max_logprob_error(_engine(path), Reference(meant, MAX_TOKENS), mixed_prompts(300)[:6], MAX_TOKENS)
        < LOGPROB_TOLERANCE
    )


@pytest.mark.slow
def test_a_block_quantized_dense_model_loads(tmp_path):
    """Llama in blocks of 16 x 48: every input width (64, 128) ends in a partial block."""
    src = make_tiny_checkpoint("llama", tmp_path)
    path, kept, meant = write_block_checkpoint(src, tmp_path, (16, 48))
    llm = _engine(path)
    assert _stored_dtype(_layer(llm, "model.layers.0.mlp.down_proj")) == FP8
    prompts = mixed_prompts(300)[:6]
    assert_greedy_parity(llm, Reference(kept, MAX_TOKENS), prompts)
    assert max_logprob_error(llm, Reference(meant, MAX_TOKENS), prompts, MAX_TOKENS) < LOGPROB_TOLERANCE


@pytest.mark.slow
def test_a_block_quantized_deepseek_v3_loads(tmp_path):
    """kv_b_proj, which MLA reads as a plain weight, gets the blocks dequantized (no second rounding);
    kv_a_proj_with_mqa's 40 rows end in a partial block of the fused q_a/kv_a layer."""
    src = make_tiny_checkpoint("deepseek_v3", tmp_path)
    path, kept, meant = write_block_checkpoint(src, tmp_path, (32, 32))
    tensors, exact = load_file(kept / "model.safetensors"), load_file(meant / "model.safetensors")
    tensors.update({name: t for name, t in exact.items() if ".kv_b_proj." in name})
    save_file(tensors, str(kept / "model.safetensors"), metadata={"format": "pt"})
    llm = _engine(path)
    assert _layer(llm, "model.layers.0.self_attn.kv_b_proj").weight.dtype == torch.float32
    assert _stored_dtype(_layer(llm, "model.layers.0.self_attn.fused_qkv_a_proj")) == FP8
    assert_greedy_parity(llm, Reference(kept, MAX_TOKENS), mixed_prompts(300)[:6])


@pytest.mark.slow
def test_transformers_reads_the_written_checkpoint_as_written(tmp_path):
    """Where every shape divides by the block, transformers' own dequantization of the block checkpoint
    gives the weights the test's dequantized twin holds: the writer lays the format out as it is read."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_checkpoint("qwen3_moe", tmp_path)
    path, _, meant = write_block_checkpoint(src, tmp_path, (32, 32))
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    ours = AutoModelForCausalLM.from_pretrained(meant, dtype=torch.float32).state_dict()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[name], ours[name]) for name in ours)
