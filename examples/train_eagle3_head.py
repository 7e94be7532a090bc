"""Train a small EAGLE-3 head for a target model on the target's own greedy outputs, and save it in the
`speculators` layout that `speculative_config={"method": "eagle3", "model": OUT}` loads.

    python examples/train_eagle3_head.py --target TARGET_DIR --out HEAD_DIR --prompts prompts.txt

What it does: transformers generates each prompt's greedy continuation (what the head must guess at
temperature 0), the target's hidden states are read where pagellm reads them (the residual stream
entering layers (2, L // 2, L - 3)), and the head (one Llama decoder layer over [embed(token);
fc(three states)]) learns, row by row, the token two places after each state: row i sees token i + 1
and the states at i. The draft vocabulary is the most frequent tokens of those outputs (`d2t`/`t2d`);
rows whose answer is outside it do not count. Training is teacher-forced, one step deep: EAGLE-3's
training-time test (feeding the head its own outputs for later steps) is left out, so acceptance of
the second and later drafts is lower than a released head's. Small on purpose: a start, not a recipe.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Head(nn.Module):
    """The EAGLE-3 head under speculators' names (`layers.0.*`, `fc`, `norm`, `lm_head`)."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        inter: int,
        draft_vocab: int,
        eps: float,
        theta: float,
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, theta
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        layer = nn.Module()
        layer.input_layernorm, layer.hidden_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        layer.post_attention_layernorm = RMSNorm(hidden, eps)
        layer.self_attn = nn.ModuleDict({
            "q_proj": nn.Linear(2 * hidden, heads * self.head_dim, bias=False),
            "k_proj": nn.Linear(2 * hidden, kv_heads * self.head_dim, bias=False),
            "v_proj": nn.Linear(2 * hidden, kv_heads * self.head_dim, bias=False),
            "o_proj": nn.Linear(heads * self.head_dim, hidden, bias=False),
        })  # fmt: skip
        layer.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(hidden, inter, bias=False),
            "up_proj": nn.Linear(hidden, inter, bias=False),
            "down_proj": nn.Linear(inter, hidden, bias=False),
        })  # fmt: skip
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        d, n = x.shape[-1], x.shape[0]
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.arange(n, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

    def forward(self, embeds: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """Draft logits of every row of one sequence (row i at position i)."""
        layer, attn, n = self.layers[0], self.layers[0].self_attn, embeds.shape[0]
        residual = self.fc(aux)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(residual)], -1)
        q = self._rope(attn["q_proj"](x).view(n, self.heads, -1)).transpose(0, 1)
        k = self._rope(attn["k_proj"](x).view(n, self.kv_heads, -1)).transpose(0, 1)
        v = attn["v_proj"](x).view(n, self.kv_heads, -1).transpose(0, 1)
        groups = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0), is_causal=True
        )
        h = attn["o_proj"](out.transpose(0, 1).reshape(n, -1)) + residual
        m = layer.post_attention_layernorm(h)
        h = layer.mlp["down_proj"](F.silu(layer.mlp["gate_proj"](m)) * layer.mlp["up_proj"](m)) + h
        return self.lm_head(self.norm(h))


@torch.no_grad()
def greedy_examples(target, tokenizer, prompts: list[str], max_new_tokens: int, layers: list[int]):
    """(token ids, the three states per token) of each prompt followed by its greedy continuation."""
    examples = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        full = target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
        states = target(full, output_hidden_states=True).hidden_states  # [i]: the stream entering layer i
        examples.append((full[0], torch.cat([states[i][0] for i in layers], -1)))
    return examples


def draft_vocabulary(examples, vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the examples, sorted (ties and unseen tokens by id)."""
    counts = torch.zeros(vocab)
    for tokens, _ in examples:
        counts += torch.bincount(tokens, minlength=vocab).float()
    return counts.topk(min(size, vocab)).indices.sort().values


def train(head: Head, embed: torch.Tensor, examples, t2d_index: torch.Tensor, steps: int, lr: float) -> None:
    """Teacher-forced steps over the examples in turn: row i (token i + 1, states at i) learns token i + 2."""
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr)
    for step in range(steps):
        tokens, aux = examples[step % len(examples)]
        if len(tokens) < 3:
            continue
        logits = head(embed[tokens[1:-1]], aux[:-2].float())
        labels = t2d_index[tokens[2:]]  # -100 outside the draft vocabulary
        loss = F.cross_entropy(logits, labels, ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0:
            accuracy = (logits.argmax(-1) == labels).float().mean().item()
            print(f"step {step}: loss {loss.item():.3f}, next-next-token accuracy {accuracy:.2f}")


def save(
    head: Head, out: Path, target_config, embed: torch.Tensor, ids: torch.Tensor, layers: list[int]
) -> None:
    """The speculators layout: config.json (speculators_model_type eagle3) and model.safetensors."""
    out.mkdir(parents=True, exist_ok=True)
    c = target_config
    layer = dict(model_type="llama", hidden_size=c.hidden_size, intermediate_size=head.layers[0].mlp["gate_proj"].out_features,
                 num_attention_heads=head.heads, num_key_value_heads=head.kv_heads, head_dim=head.head_dim,
                 num_hidden_layers=1, rms_norm_eps=head.norm.eps, vocab_size=c.vocab_size, hidden_act="silu",
                 max_position_embeddings=c.max_position_embeddings, rope_theta=head.theta)  # fmt: skip
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": len(ids),
              "eagle_aux_hidden_state_layer_ids": layers, "norm_before_residual": False, "target_hidden_size": None,
              "transformer_layer_config": layer}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: p.detach().contiguous() for name, p in head.state_dict().items()}
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors.update(
        {"embed_tokens.weight": embed.contiguous(), "d2t": ids - torch.arange(len(ids)), "t2d": t2d}
    )
    save_file(tensors, str(out / "model.safetensors"))


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the target model's directory (transformers layout)")
    parser.add_argument("--out", required=True, type=Path, help="where to write the head")
    parser.add_argument("--prompts", required=True, type=Path, help="a text file, one prompt a line")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    c = target.config
    layers = [2, c.num_hidden_layers // 2, c.num_hidden_layers - 3]  # pagellm's (and vLLM's) default
    if min(layers) < 0:
        raise SystemExit(f"the target has {c.num_hidden_layers} layers; the default layers need at least 3")
    prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    examples = greedy_examples(target, tokenizer, prompts, args.max_new_tokens, layers)
    ids = draft_vocabulary(examples, c.vocab_size, args.draft_vocab)
    t2d_index = torch.full((c.vocab_size,), -100, dtype=torch.long)
    t2d_index[ids] = torch.arange(len(ids))
    heads, kv_heads = c.num_attention_heads, getattr(c, "num_key_value_heads", c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    head = Head(c.hidden_size, heads, kv_heads, head_dim, c.intermediate_size, len(ids), c.rms_norm_eps,
                float(c.rope_parameters.get("rope_theta", 10000.0)))  # fmt: skip
    embed = target.get_input_embeddings().weight.detach().float()
    train(head, embed, examples, t2d_index, args.steps, args.lr)
    save(head, args.out, c, embed, ids, layers)
    print(f"saved to {args.out}: speculative_config={{'method': 'eagle3', 'model': '{args.out}', ...}}")


if __name__ == "__main__":
    main()
