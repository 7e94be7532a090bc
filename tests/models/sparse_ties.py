"""Near-ties in the lightning indexer's top-k (DeepSeek-V3.2, GLM-5, DeepSeek-V4), found on transformers'
side: where the k-th and (k+1)-th best scores a query sees are (nearly) equal, which tokens (or pooled
rows) it reads is arbitrary, in transformers as in pagellm (exact zeros after the ReLU tie easily in tiny
models). Parity tests name them when tokens diverge (`indexer_ties_note`, used by
parity.assert_greedy_parity), so a tie is reported as such, never absorbed by a tolerance."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-5  # relative gap between the k-th and (k+1)-th indexer scores reported as a near-tie


@torch.no_grad()
def indexer_near_ties(model: torch.nn.Module, ids: list[int]) -> list[str]:
    """transformers' indexer scores of every layer along `ids` (one forward), recomputed from each
    indexer's inputs as DeepseekV32Indexer computes them; one line per query whose k-th and (k+1)-th best
    visible scores are within NEAR_TIE (relative), where the choice between them is arbitrary."""
    if model.config.model_type == "deepseek_v4":
        return v4_indexer_near_ties(model, ids)
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    # GLM-5's indexer rotates interleaved pairs, DeepSeek-V3.2's halves
    rotate = (
        apply_rotary_pos_emb_interleave if model.config.model_type == "glm_moe_dsa" else apply_rotary_pos_emb
    )
    captured: list[tuple[int, torch.nn.Module, tuple]] = []
    hooks = [
        layer.self_attn.indexer.register_forward_hook(lambda m, args, out, i=i: captured.append((i, m, args)))
        for i, layer in enumerate(model.model.layers)
        if layer.self_attn.indexer is not None  # GLM-5's "shared" layers have none
    ]
    try:
        model(torch.tensor([ids], device=model.device))
    finally:
        for hook in hooks:
            hook.remove()
    ties = []
    for layer, m, args in captured:
        hidden, q_resid, (cos, sin) = args[0], args[1], args[2]
        q = m.wq_b(q_resid).view(1, len(ids), m.n_heads, m.head_dim)
        k = m.k_norm(m.wk(hidden)).unsqueeze(2)
        rope = m.qk_rope_head_dim
        q_rot, k_rot = rotate(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q[..., rope:]], -1), torch.cat([k_rot, k[..., rope:]], -1).squeeze(2)
        scores = torch.relu(
            torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * m.softmax_scale
        )
        weights = m.weights_proj(hidden.float()) * m.n_heads**-0.5
        index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)[0]  # [S, S]
        for p in range(m.index_topk, len(ids)):  # queries with more visible tokens than k
            best = index[p, : p + 1].sort(descending=True).values
            kth, next_ = float(best[m.index_topk - 1]), float(best[m.index_topk])
            if abs(kth - next_) <= NEAR_TIE * max(abs(kth), abs(next_), 1e-30):
                ties.append(f"layer {layer}, position {p}: k-th score {kth:.9g}, next {next_:.9g}")
    return ties


@torch.no_grad()
def v4_indexer_near_ties(model: torch.nn.Module, ids: list[int]) -> list[str]:
    """transformers' indexer scores of every compressed-sparse layer along `ids` (one forward, no cache);
    one line per query whose k-th and (k+1)-th best scores among its finished pooled rows are within
    NEAR_TIE (relative), where which row it reads is arbitrary."""
    captured: list[tuple[int, int, int, torch.Tensor]] = []
    hooks = []
    for i, layer in enumerate(model.model.layers):
        compressor = layer.self_attn.compressor
        indexer = getattr(compressor, "indexer", None)
        if indexer is None:
            continue
        keep = (i, indexer.compress_rate, indexer.index_topk)
        hooks.append(
            indexer.scorer.register_forward_hook(lambda m, a, out, k=keep: captured.append((*k, out)))
        )
    try:
        model(torch.tensor([ids], device=model.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(captured) == model.config.layer_types.count("compressed_sparse_attention")
    ties = []
    for layer, rate, topk, scores in captured:
        for p in range(len(ids)):
            finished = scores[0, p, : (p + 1) // rate]
            if finished.numel() <= topk:
                continue
            best = finished.sort(descending=True).values
            kth, next_ = float(best[topk - 1]), float(best[topk])
            if abs(kth - next_) <= NEAR_TIE * max(abs(kth), abs(next_), 1e-30):
                ties.append(f"layer {layer}, position {p}: k-th score {kth:.9g}, next {next_:.9g}")
    return ties


def indexer_ties_note(model: torch.nn.Module, ids: list[int]) -> str:
    """For a failure message: the indexer's near-ties along `ids`, or "" for a model without an indexer."""
    if getattr(model.config, "index_topk", None) is None:
        return ""
    ties = indexer_near_ties(model, ids)
    return "\nindexer near-ties at the k-th score along transformers' tokens: " + ("; ".join(ties) or "none")
