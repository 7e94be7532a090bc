"""Run by test_parallel_layers.py as `python layers_on_ranks.py RANK WORLD DIR`: each parallel layer on this
rank, in float32, against its dense reference built from the same full weights; prints OK or raises."""

from __future__ import annotations

import sys

import torch

from pagellm.distributed import init_parallel
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.linear import Linear, Shard


def main(rank: int, world: int, directory: str) -> None:
    parallel = init_parallel(rank, world, 1, f"file://{directory}/rendezvous", "gloo", 30.0)
    tp = parallel.tp
    torch.manual_seed(0)  # every rank draws the same full weights and inputs
    hidden, vocab, heads, head = 32, 37, 4, 8  # vocab not a multiple of the ranks; one KV head
    x = torch.randn(5, hidden)

    # column parallel q/k/v: query heads split, the single KV head replicated on every rank
    q_w, k_w, v_w = torch.randn(heads * head, hidden), torch.randn(head, hidden), torch.randn(head, hidden)
    q_b, k_b, v_b = torch.randn(heads * head), torch.randn(head), torch.randn(head)
    q_local = heads // world * head
    sizes = [q_local, head, head]
    qkv = Linear(
        hidden,
        sum(sizes),
        True,
        torch.float32,
        None,
        sizes,
        Shard(0, ((rank * q_local, q_local), (0, head), (0, head))),
    )
    for part, (w, b) in enumerate(((q_w, q_b), (k_w, k_b), (v_w, v_b))):
        qkv.load_shard(qkv.weight, qkv.narrow_checkpoint("weight", w, part), part)
        qkv.load_shard(qkv.bias, qkv.narrow_checkpoint("bias", b, part), part)
    q, k, v = qkv(x).split(sizes, dim=-1)
    torch.testing.assert_close(q, (x @ q_w.T + q_b)[:, rank * q_local : (rank + 1) * q_local])
    torch.testing.assert_close(k, x @ k_w.T + k_b)
    torch.testing.assert_close(v, x @ v_w.T + v_b)

    # row parallel with a bias: partial products summed over the ranks, the bias added once
    w, b = torch.randn(hidden, heads * head), torch.randn(hidden)
    row = Linear(
        q_local, hidden, True, torch.float32, shard=Shard(1, ((rank * q_local, q_local),)), reduce=tp
    )
    row.weight.data.copy_(row.narrow_checkpoint("weight", w, None))
    row.bias.data.copy_(row.narrow_checkpoint("bias", b, None))
    full_in = torch.randn(5, heads * head)
    torch.testing.assert_close(row(full_in[:, rank * q_local : (rank + 1) * q_local]), full_in @ w.T + b)

    # vocabulary parallel embedding over a vocabulary padded to a multiple of the ranks, every id covered
    table = torch.randn(vocab, hidden)
    embed = Embedding(vocab, hidden, torch.float32, tp)
    embed.weight.data.copy_(embed.narrow_checkpoint("weight", table, None))
    ids = torch.arange(vocab).flip(0)
    torch.testing.assert_close(embed(ids), table[ids])
    # ... and the output projection through it: each rank's slice of the logits, gathered and trimmed
    logits = tp.all_gather(x @ embed.weight.T, dim=-1)[:, :vocab]
    torch.testing.assert_close(logits, x @ table.T)
    parallel.close()
    print("OK", rank)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
