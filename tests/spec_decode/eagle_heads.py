"""Random EAGLE-3 heads for tiny targets, written in the two layouts pagellm loads (EAGLE-3's own and the
`speculators` package's), and a plain-PyTorch reference of what such a head drafts: no KV cache, every
row recomputed from the transformers target's hidden states, so the engine's cached drafting can be
checked against it token by token."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

HEAD = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-6, max_position_embeddings=512, rope_theta=10000.0, hidden_act="silu")  # fmt: skip


def head_tensors(vocab: int, draft_vocab: int, seed: int, embed: bool) -> dict[str, torch.Tensor]:
    """A head's tensors under speculators' names (`layers.0.*`), with a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    h, inter = HEAD["hidden_size"], HEAD["intermediate_size"]
    q, kv = HEAD["num_attention_heads"] * HEAD["head_dim"], HEAD["num_key_value_heads"] * HEAD["head_dim"]

    def rand(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": rand(h, 3 * h, scale=0.1),
        "layers.0.input_layernorm.weight": 1 + rand(h),
        "layers.0.hidden_norm.weight": 1 + rand(h),
        "layers.0.post_attention_layernorm.weight": 1 + rand(h),
        "layers.0.self_attn.q_proj.weight": rand(q, 2 * h),
        "layers.0.self_attn.k_proj.weight": rand(kv, 2 * h),
        "layers.0.self_attn.v_proj.weight": rand(kv, 2 * h),
        "layers.0.self_attn.o_proj.weight": rand(h, q),
        "layers.0.mlp.gate_proj.weight": rand(inter, h),
        "layers.0.mlp.up_proj.weight": rand(inter, h),
        "layers.0.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": 1 + rand(h),
        "lm_head.weight": rand(draft_vocab, h, scale=1.0),
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    if embed:
        tensors["embed_tokens.weight"] = rand(vocab, h, scale=1.0)
    return tensors


def write_speculators_head(
    out: Path, vocab: int, draft_vocab: int, aux_ids, seed: int = 0, always: int | None = None
) -> Path:
    """The speculators layout: `speculators_model_type: eagle3`, the layer in `transformer_layer_config`,
    its own embed_tokens. `always`: a head that drafts that token whatever it reads (its final norm's
    weight zero, so every draft logit is 0 and draft id 0 wins, which `d2t` maps to `always`)."""
    out.mkdir(parents=True, exist_ok=True)
    layer = dict(HEAD, model_type="llama", num_hidden_layers=1, vocab_size=vocab)
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": draft_vocab,
        "eagle_aux_hidden_state_layer_ids": list(aux_ids), "norm_before_residual": False,
        "target_hidden_size": None, "transformer_layer_config": layer,
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": 3}], "verifier": {"name_or_path": "tiny"}},
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    tensors = head_tensors(vocab, draft_vocab, seed, embed=True)
    if always is not None:
        tensors["norm.weight"].zero_()
        tensors["d2t"][0] = always
    save_file(tensors, str(out / "model.safetensors"))
    return out


def write_eagle3_head(out: Path, vocab: int, draft_vocab: int, seed: int = 1) -> Path:
    """EAGLE-3's own layout: a LlamaForCausalLMEagle3 config, `midlayer.*`, no embed_tokens (the target's
    is shared), the default auxiliary layers, as a pytorch_model.bin like the released heads."""
    out.mkdir(parents=True, exist_ok=True)
    config = dict(HEAD, architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  vocab_size=vocab, draft_vocab_size=draft_vocab)  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    tensors = {
        k.replace("layers.0.", "midlayer."): v
        for k, v in head_tensors(vocab, draft_vocab, seed, False).items()
    }
    torch.save(tensors, out / "pytorch_model.bin")
    return out


class ReferenceHead:
    """What the head drafts after `tokens`, computed without a cache from the transformers target."""

    def __init__(self, head_dir: Path, target, aux_ids, embed: torch.Tensor | None = None):
        config = json.loads((head_dir / "config.json").read_text())
        files = list(head_dir.glob("*.safetensors"))
        raw = (
            {k: v for f in files for k, v in load_file(f).items()}
            if files
            else torch.load(head_dir / "pytorch_model.bin")
        )
        self.w = {
            k.replace("midlayer.", "layers.0."): v.float() if v.is_floating_point() else v
            for k, v in raw.items()
        }
        self.embed = self.w.get("embed_tokens.weight", embed)
        self.target, self.aux_ids = target, list(aux_ids)
        self.eps = config.get("transformer_layer_config", config)["rms_norm_eps"]

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        inv = 1.0 / (HEAD["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        angles = positions[:, None].float() * inv[None]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + half * sin

    def _layer(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits, output before the norm) of every row; row i is at position i."""
        w, n, hd = self.w, tokens.shape[0], HEAD["head_dim"]
        residual = hidden
        x = torch.cat([self._norm(self.embed[tokens], "layers.0.input_layernorm.weight"),
                       self._norm(hidden, "layers.0.hidden_norm.weight")], -1)  # fmt: skip
        positions = torch.arange(n)
        q = self._rope((x @ w["layers.0.self_attn.q_proj.weight"].T).view(n, -1, hd), positions)
        k = self._rope((x @ w["layers.0.self_attn.k_proj.weight"].T).view(n, -1, hd), positions)
        v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(n, -1, hd)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        h = attn.transpose(0, 1).reshape(n, -1) @ w["layers.0.self_attn.o_proj.weight"].T + residual
        m = self._norm(h, "layers.0.post_attention_layernorm.weight")
        m = F.silu(m @ w["layers.0.mlp.gate_proj.weight"].T) * (m @ w["layers.0.mlp.up_proj.weight"].T)
        out = m @ w["layers.0.mlp.down_proj.weight"].T + h
        return self._norm(out, "norm.weight") @ w["lm_head.weight"].T, out

    @torch.no_grad()
    def draft_logits(self, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
        """Target-vocabulary logits (-inf outside the draft vocabulary) of each chain step, the earlier
        steps fed `drafts` (the engine's): step j's argmax is what the head proposes as draft j."""
        ids = torch.tensor([tokens])
        states = self.target(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in self.aux_ids], -1)  # the stream entering each layer
        hidden = aux[:-1] @ self.w["fc.weight"].T
        inputs = torch.tensor(tokens[1:])
        out = []
        for j in range(len(drafts)):
            logits, pre = self._layer(inputs, hidden)
            full = torch.full((self.embed.shape[0],), float("-inf"))
            draft_ids = torch.arange(logits.shape[1])
            full[draft_ids + self.w["d2t"]] = logits[-1]
            out.append(full)
            inputs = torch.cat([inputs, torch.tensor([drafts[j]])])
            hidden = torch.cat([hidden, pre[-1:]])
        return out
