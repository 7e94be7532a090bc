import torch
from transformers import LlamaConfig

from pagellm.models.layers.rotary import RotaryEmbedding, apply_rotary


def test_compiled_cos_sin_are_computed_once_not_per_layer(tmp_path, monkeypatch):
    """Inductor inlined cos/sin into every layer's rotation (per head, too); compiled, they come from
    one opaque op per forward and the rotations match eager."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
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
    out, code = run_and_get_code(compiled, positions, q, k)
    torch.testing.assert_close(out, two_layers(positions, q, k))
    source = "\n".join(code)
    assert "rope_cos_sin" in source
    assert ".cos()" not in source and ".sin()" not in source
