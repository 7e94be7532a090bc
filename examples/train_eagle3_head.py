"""Train a small EAGLE-3 head for a target model on the target's own greedy outputs, and save it in the
`speculators` layout that `speculative_config={"method": "eagle3", "model": OUT}` loads.

    python examples/train_eagle3_head.py --target S --out HEAD_DIR --chat 800 --epochs 2
    python examples/train_eagle3_head.py --target TARGET_DIR --out HEAD_DIR --prompts prompts.txt

What it does: pagellm generates each prompt's greedy continuation in bfloat16 (what the head must guess
at temperature 0; `--chat N`: N chat questions of `pagellm.bench.workloads.chat_questions`, from another
seed than `pagellm bench latency --prompts chat` draws), transformers reads the target's hidden states
(in float32, or rounded to bfloat16 as served: `--states-dtype`) where pagellm reads them (the residual
stream entering layers (2, L // 2, L - 3)), and the head (one Llama decoder layer over [embed(token);
fc(three states)]) learns the token two places after each state: row i sees token i + 1 and the states
at i. With `--depth k` (EAGLE-3's training-time test) it
also learns the later drafts as the proposer makes them: step s of row i sees token i + s and the head's
own output of step s - 1 as its hidden state, attends to step 1's rows up to i and its own earlier steps
of row i, and learns token i + s + 1. Only tokens the proposer is asked for count in the loss: those after
the target's first output token (the prompt's rows are read, as keys, but a draft is never asked to guess
the prompt or the chat template around it). The draft vocabulary is the most frequent tokens of those outputs
(`d2t`/`t2d`); its lm_head starts as the target's rows of those tokens; rows whose answer is outside it
do not count. Small on purpose: minutes on two cores for a 135M target, not a released head's recipe.
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

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = positions.float()[:, None] * inv[None]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

    def forward(self, embeds: list[torch.Tensor], aux: torch.Tensor) -> list[torch.Tensor]:
        """Draft logits of every row of one sequence at each of `len(embeds)` steps (`embeds[s]`: the
        token embeddings step s + 1 reads, a row per state of `aux`). Row i of step s is at position
        i + s and attends to step 1's rows 0..i and its own row i of the steps before, as the proposer's
        k-th draft sees the cache; each step's hidden state is the step before's output."""
        layer, attn, n, depth = self.layers[0], self.layers[0].self_attn, aux.shape[0], len(embeds)
        rows = torch.arange(n)
        positions = torch.cat([rows + s for s in range(depth)])
        step = torch.arange(depth).repeat_interleave(n)
        row = rows.repeat(depth)
        mask = ((step[None, :] == 0) & (row[None, :] <= row[:, None])) | (
            (step[None, :] > 0) & (step[None, :] <= step[:, None]) & (row[None, :] == row[:, None])
        )
        hidden, logits = self.fc(aux), []
        keys, values = [], []
        for s in range(depth):
            residual = hidden
            x = torch.cat([layer.input_layernorm(embeds[s]), layer.hidden_norm(residual)], -1)
            at = positions[s * n : (s + 1) * n]
            q = self._rope(attn["q_proj"](x).view(n, self.heads, -1), at)
            keys.append(self._rope(attn["k_proj"](x).view(n, self.kv_heads, -1), at))
            values.append(attn["v_proj"](x).view(n, self.kv_heads, -1))
            groups = self.heads // self.kv_heads
            k = torch.cat(keys).repeat_interleave(groups, 1).transpose(0, 1)
            v = torch.cat(values).repeat_interleave(groups, 1).transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k, v, attn_mask=mask[s * n : (s + 1) * n, : (s + 1) * n]
            )
            h = attn["o_proj"](out.transpose(0, 1).reshape(n, -1)) + residual
            m = layer.post_attention_layernorm(h)
            hidden = layer.mlp["down_proj"](F.silu(layer.mlp["gate_proj"](m)) * layer.mlp["up_proj"](m)) + h
            logits.append(self.lm_head(self.norm(hidden)))
        return logits


def greedy_outputs(target: str, prompts: list[list[int]], max_new_tokens: int) -> list[torch.Tensor]:
    """Each prompt followed by the target's greedy continuation, from pagellm in bfloat16 (the dtype the
    head will draft for), `max_new_tokens` each: end-of-turn tokens do not stop them, so the head also
    sees what follows one (as `pagellm bench latency`, which ignores them, will ask it)."""
    from pagellm import LLM, SamplingParams

    llm = LLM(target, dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [torch.tensor(p + list(o.outputs[0].token_ids)) for p, o in zip(prompts, outputs, strict=True)]


@torch.no_grad()
def hidden_states(target, sequences: list[torch.Tensor], layers: list[int], prompt_lens: list[int]):
    """(token ids, the three states per token in bfloat16, the prompt's length) of each sequence, from
    transformers."""
    examples = []
    for tokens, prompt_len in zip(sequences, prompt_lens, strict=True):
        states = target(tokens[None], output_hidden_states=True).hidden_states  # [i]: entering layer i
        examples.append((tokens, torch.cat([states[i][0] for i in layers], -1).bfloat16(), prompt_len))
    return examples


def draft_vocabulary(examples, vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the examples, sorted (ties and unseen tokens by id)."""
    counts = torch.zeros(vocab)
    for tokens, _, _ in examples:
        counts += torch.bincount(tokens, minlength=vocab).float()
    return counts.topk(min(size, vocab)).indices.sort().values


def draft_labels(
    tokens: torch.Tensor, prompt_len: int, t2d_index: torch.Tensor, depth: int
) -> list[torch.Tensor]:
    """What step s (1..depth) of each row learns, as draft-vocabulary ids: row i's answer is token i + s + 1
    (the states at i, token i + s read); -100 (not counted) past the sequence's end, where the answer is in
    the prompt or is the target's first output token (no draft guesses those), or is outside the draft
    vocabulary."""
    n = len(tokens) - 1
    padded = torch.cat([tokens, tokens.new_zeros(depth + 1)])
    labels = [t2d_index[padded[s + 2 : s + 2 + n]] for s in range(depth)]
    for s in range(depth):
        labels[s][max(0, n - 1 - s) :] = -100  # past the end
        labels[s][: max(0, prompt_len - 1 - s)] = -100  # row i's answer is token i + s + 2 <= prompt_len
    return labels


def train(
    head: Head, embed: torch.Tensor, examples, t2d_index: torch.Tensor, epochs: int, lr: float, depth: int
) -> None:
    """Epochs over the examples in a seeded order, one sequence a step, AdamW with a cosine schedule. Step s
    (1..depth) of row i reads token i + s and learns token i + s + 1; rows past the sequence's end, whose
    answer is in the prompt or is the target's first output token (no draft guesses those), or is outside
    the draft vocabulary, do not count."""
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr)
    total = epochs * len(examples)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: 0.5 * (1 + torch.cos(torch.tensor(k / total * torch.pi)).item())
    )
    order = torch.cat([torch.randperm(len(examples)) for _ in range(epochs)]).tolist()
    correct, counted = torch.zeros(depth), torch.zeros(depth)
    for k, e in enumerate(order):
        tokens, aux, prompt_len = examples[e]
        n = len(tokens) - 1  # rows: the states at 0..n-1
        if n < depth + 1:
            continue
        padded = torch.cat([tokens, tokens.new_zeros(depth + 1)])
        embeds = [embed[padded[s + 1 : s + 1 + n]] for s in range(depth)]
        logits = head(embeds, aux[:n].float())
        labels = draft_labels(tokens, prompt_len, t2d_index, depth)
        if all(bool((lb == -100).all()) for lb in labels):
            continue  # nothing to learn here (a prompt with too short an output)
        loss = sum(F.cross_entropy(lg, lb, ignore_index=-100) for lg, lb in zip(logits, labels, strict=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        for s in range(depth):
            valid = labels[s] != -100
            correct[s] += (logits[s].argmax(-1)[valid] == labels[s][valid]).sum()
            counted[s] += valid.sum()
        if (k + 1) % 100 == 0 or k + 1 == total:
            accuracy = " ".join(f"{c / max(n, 1):.2f}" for c, n in zip(correct, counted, strict=True))
            print(f"step {k + 1}/{total}: loss {loss.item() / depth:.3f}, accuracy per draft {accuracy}")
            correct.zero_()
            counted.zero_()


def save(head: Head, out: Path, target_config, ids: torch.Tensor, layers: list[int]) -> None:
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
    tensors.update({"d2t": ids - torch.arange(len(ids)), "t2d": t2d})  # embed_tokens: the target's
    save_file(tensors, str(out / "model.safetensors"))


def load_target(path: str):
    """(tokenizer, the transformers model in float32) of a checkpoint directory, or of a GGUF file (its
    tensors dequantized by pagellm's reader, as pagellm serves it: model S is one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return AutoTokenizer.from_pretrained(path), model.eval()
    from pagellm.models.gguf_checkpoint import load_gguf

    config, tokenizer, weights = load_gguf(path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing = model.load_state_dict(dict(weights), strict=False).missing_keys
    if missing not in ([], ["lm_head.weight"]) or (missing and not config.tie_word_embeddings):
        raise SystemExit(f"{path}: the file has no {', '.join(missing)}")
    return tokenizer, model.eval()


def main() -> None:
    from pagellm.bench.workloads import chat_ids, chat_questions, resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--target",
        required=True,
        help="the target: a checkpoint directory, a GGUF file, or S (the bench's model S)",
    )
    parser.add_argument("--out", required=True, type=Path, help="where to write the head")
    prompts_from = parser.add_mutually_exclusive_group(required=True)
    prompts_from.add_argument("--prompts", type=Path, help="a text file, one user message a line")
    prompts_from.add_argument(
        "--chat", type=int, help="this many chat questions (seed 1), none that the bench asks"
    )
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--depth", type=int, default=3, help="drafts trained for (training-time test)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--states-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the dtype transformers reads the target's hidden states in (bfloat16: rounded as pagellm's "
        "bfloat16 serving rounds them)",
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    path = resolve_model(args.target)
    tokenizer, target = load_target(path)
    if args.chat:
        # none of the questions `pagellm bench latency --prompts chat` asks (its first 64, seed 0)
        texts = chat_questions(args.chat, seed=1, avoid=chat_questions(64, seed=0))
    else:
        texts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [chat_ids(tokenizer, t) for t in texts]
    sequences = greedy_outputs(path, prompts, args.max_new_tokens)
    c = target.config
    layers = [2, c.num_hidden_layers // 2, c.num_hidden_layers - 3]  # pagellm's (and vLLM's) default
    if min(layers) < 0:
        raise SystemExit(f"the target has {c.num_hidden_layers} layers; the default layers need at least 3")
    examples = hidden_states(
        target.to(getattr(torch, args.states_dtype)), sequences, layers, [len(p) for p in prompts]
    )
    target.float()
    ids = draft_vocabulary(examples, c.vocab_size, args.draft_vocab)
    t2d_index = torch.full((c.vocab_size,), -100, dtype=torch.long)
    t2d_index[ids] = torch.arange(len(ids))
    heads, kv_heads = c.num_attention_heads, getattr(c, "num_key_value_heads", c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    head = Head(c.hidden_size, heads, kv_heads, head_dim, c.intermediate_size, len(ids), c.rms_norm_eps,
                float(c.rope_parameters.get("rope_theta", 10000.0)))  # fmt: skip
    with torch.no_grad():  # start from the target's output rows of the draft vocabulary and its final norm
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[ids])
        head.norm.weight.copy_(target.model.norm.weight)
    embed = target.get_input_embeddings().weight.detach().float()
    del target
    train(head, embed, examples, t2d_index, args.epochs, args.lr, args.depth)
    save(head, args.out, c, ids, layers)
    print(f"saved to {args.out}: speculative_config={{'method': 'eagle3', 'model': '{args.out}', ...}}")


if __name__ == "__main__":
    main()
