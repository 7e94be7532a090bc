import pytest
import torch
from parity import PHI3_LONGROPE
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary

from pagellm.models.context import set_forward_context
from pagellm.models.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    mrope_axes,
    prefix_cache_salt,
    rope_salt_function,
    scaled_max_positions,
)

SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


def llama(rope_parameters: dict, max_position_embeddings: int = 256) -> LlamaConfig:
    return LlamaConfig(
        **SIZES, max_position_embeddings=max_position_embeddings, rope_parameters=rope_parameters
    )


def phi3_longrope() -> Phi3Config:
    return Phi3Config(**SIZES, max_position_embeddings=512, **PHI3_LONGROPE)


def dynamic() -> LlamaConfig:
    return llama({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}, max_position_embeddings=64)


def theirs(module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin for one forward over `positions` ([T]), first half of the rotated features."""
    cos, sin = module(torch.zeros(1, dtype=torch.float32), positions[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def ours(rope: RotaryEmbedding, positions: torch.Tensor, lengths: torch.Tensor | None = None):
    with set_forward_context(None, [], rope_lengths=lengths):
        return rope.cos_sin(positions)


STATIC = {
    "linear": llama({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "yarn": llama(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    ),
    "yarn-mscale": llama(
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        }
    ),
    "yarn-attention-factor": llama(
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
            "attention_factor": 1.3,
        }
    ),
    "llama3": llama(
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
    ),
}


@pytest.mark.parametrize("name", list(STATIC))
def test_static_rope_types_match_transformers_past_the_original_length(name):
    """cos/sin, attention factor included, equal transformers' rotary module's up to 4x the original length."""
    config = STATIC[name]
    positions = torch.arange(300)
    cos, sin = ours(RotaryEmbedding(config), positions)
    ref_cos, ref_sin = theirs(LlamaRotaryEmbedding(config), positions)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6)
    if name.startswith("yarn"):
        assert RotaryEmbedding(config).scaling != 1.0


@pytest.mark.parametrize(
    "make,module,lengths",
    [
        (phi3_longrope, Phi3RotaryEmbedding, [1, 31, 32, 33, 100, 400]),  # threshold 32
        (dynamic, LlamaRotaryEmbedding, [1, 63, 64, 65, 100, 250]),  # threshold 64
    ],
    ids=["longrope", "dynamic"],
)
def test_length_dependent_types_match_a_transformers_forward_of_that_length(make, module, lengths):
    """A forward over positions 0..L-1 (transformers picks the frequencies for L) equals ours with each
    token's length L; a batch of several such sequences in one call equals each on its own (per token)."""
    config = make()
    rope = RotaryEmbedding(config)
    assert rope.by_length
    ref_cos, ref_sin, all_positions, all_lengths = [], [], [], []
    for length in lengths:
        positions = torch.arange(length)
        c, s = theirs(module(config), positions)  # a fresh module: transformers' dynamic state grows
        cos, sin = ours(rope, positions, torch.full((length,), length))
        torch.testing.assert_close(cos, c, rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, s, rtol=0, atol=1e-6)
        ref_cos.append(c), ref_sin.append(s)
        all_positions.append(positions), all_lengths.append(torch.full((length,), length))
    cos, sin = ours(rope, torch.cat(all_positions), torch.cat(all_lengths))
    torch.testing.assert_close(cos, torch.cat(ref_cos), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, torch.cat(ref_sin), rtol=0, atol=1e-6)
    # without lengths (a CUDA-graph decode step) each token's is its position + 1: a decode forward's
    positions = torch.tensor([0, 20, 63, 64, 200])
    cos, _ = ours(rope, positions)
    for row, p in enumerate(positions.tolist()):
        torch.testing.assert_close(
            cos[row], theirs(module(config), torch.tensor([p]))[0][0], rtol=0, atol=1e-6
        )


def test_longrope_attention_factor_and_long_factors_differ_from_the_short():
    config = phi3_longrope()
    rope = RotaryEmbedding(config)
    # factor 512 / 32 = 16: attention factor sqrt(1 + ln 16 / ln 32)
    assert rope.scaling == pytest.approx(
        (1 + torch.log(torch.tensor(16.0)) / torch.log(torch.tensor(32.0))) ** 0.5
    )
    assert rope.rotary_dim == 12 and rope.inv_freq.shape == (2, 6)
    short, _ = ours(rope, torch.tensor([20]), torch.tensor([32]))
    long, _ = ours(rope, torch.tensor([20]), torch.tensor([33]))
    assert not torch.allclose(short, long)


def test_partial_rotary_rotates_only_the_first_features_as_transformers():
    config = phi3_longrope()  # 16-wide heads, 12 features rotate
    rope = RotaryEmbedding(config)
    positions = torch.arange(40)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(40, 4, 16, generator=gen), torch.randn(40, 2, 16, generator=gen)
    cos, sin = ours(rope, positions, torch.full((40,), 40))
    ref_cos, ref_sin = Phi3RotaryEmbedding(config)(q, positions[None])
    ref_q, ref_k = phi3_apply_rotary(q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1), rtol=0, atol=1e-6)
    assert torch.equal(apply_rotary(q, cos, sin)[..., 12:], q[..., 12:])


def test_prefix_cache_salt_follows_the_length_the_kv_was_rotated_for():
    longrope = phi3_longrope()
    assert rope_salt_function(longrope) is not None and rope_salt_function(llama({})) is None
    assert prefix_cache_salt(longrope, 20, 32) == prefix_cache_salt(longrope, 32, 32)
    assert prefix_cache_salt(longrope, 20, 33) != prefix_cache_salt(longrope, 20, 32)  # outgrown: recomputed
    config = dynamic()
    assert prefix_cache_salt(config, 64, 200) is None  # up to max_position_embeddings: unscaled
    assert prefix_cache_salt(config, 65, 70) != prefix_cache_salt(config, 66, 70)


def test_scaled_max_positions_as_vllm():
    assert scaled_max_positions(STATIC["linear"], 256) == 512
    assert scaled_max_positions(dynamic(), 64) == 256
    assert scaled_max_positions(STATIC["yarn"], 256) == 256  # 64 x 4
    assert scaled_max_positions(STATIC["llama3"], 256) == 256
    assert scaled_max_positions(phi3_longrope(), 512) == 512
    assert scaled_max_positions(llama({}), 256) == 256


@pytest.mark.slow
@pytest.mark.parametrize("rope_type", ["default", "longrope"])
def test_compiled_cos_sin_are_computed_once_not_per_layer(tmp_path, monkeypatch, rope_type):
    """Inductor inlined cos/sin into every layer's rotation (per head, too); compiled, they come from
    one opaque op per forward (a length-dependent type's reads the step's lengths inside) and the
    rotations match eager."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    if rope_type == "default":
        config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    else:
        config = phi3_longrope()
    rope = RotaryEmbedding(config)

    def two_layers(positions, q, k):
        cos, sin = rope.cos_sin(positions)
        for _ in range(2):
            q, k = apply_rotary(q, cos, sin) * 1.5, apply_rotary(k, cos, sin) + 1
        return q, k

    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 5, 17, 300])
    q, k = torch.randn(4, 4, 16, generator=gen), torch.randn(4, 2, 16, generator=gen)
    compiled = torch.compile(two_layers, fullgraph=True, dynamic=True)
    with set_forward_context(None, [], rope_lengths=torch.tensor([20, 20, 40, 301])):
        out, code = run_and_get_code(compiled, positions, q, k)
        torch.testing.assert_close(out, two_layers(positions, q, k))
    source = "\n".join(code)
    assert ("rope_cos_sin_by_length" if rope_type == "longrope" else "rope_cos_sin") in source
    assert ".cos()" not in source and ".sin()" not in source


def test_interleaved_mrope_equals_qwen3_vl():
    """Qwen3-VL's rope at its released sections: each frequency's angle from the axis transformers
    recomposes it from (t, h, w positions that differ on every axis)."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    params = {
        "rope_type": "default",
        "rope_theta": 5e6,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    }
    config = Qwen3VLTextConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_parameters=params)
    rotary = RotaryEmbedding(config)
    positions = torch.stack([torch.arange(9), torch.arange(9) * 3 + 1, torch.arange(9) * 7 + 2])
    cos, sin = rotary.cos_sin(positions)
    want_cos, want_sin = Qwen3VLTextRotaryEmbedding(config)(torch.zeros(1), positions[:, None, :])
    torch.testing.assert_close(torch.cat([cos, cos], -1), want_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([sin, sin], -1), want_sin[0], rtol=0, atol=0)


def test_mrope_cos_sin_op_is_laid_out_as_its_fake():
    """A compiled graph reads the op's outputs by the strides its fake gives: contiguous."""
    axes = mrope_axes({"mrope_section": [3, 3, 2], "mrope_interleaved": True}, 8)
    inv_freq = 1.0 / (10000 ** (torch.arange(8) / 8))
    torch.library.opcheck(torch.ops.pagellm.mrope_cos_sin, (torch.arange(21).view(3, 7), inv_freq, axes, 1.0))
