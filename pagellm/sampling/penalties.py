"""Repetition, presence and frequency penalties over a batch of logits rows, without a loop over tokens."""

from __future__ import annotations

import torch


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each token occurs in each row of `token_ids` [N, L] (padded with -1) -> [N, vocab_size]."""
    ids = token_ids.masked_fill(token_ids < 0, vocab_size)
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Return logits [N, V] with the penalties applied.

    Repetition (Hugging Face): every token seen in the prompt or the output has a positive logit divided
    by the penalty and a negative one multiplied. Presence and frequency (OpenAI): subtract
    `frequency * count + presence * (count > 0)` over the output tokens only. Penalties are [N] floats.
    """
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_ids, vocab_size)
    seen = (token_counts(prompt_ids, vocab_size) > 0) | (output_counts > 0)
    rep = repetition.unsqueeze(1).expand_as(logits)
    scale = torch.where(logits > 0, 1.0 / rep, rep)
    logits = torch.where(seen, logits * scale, logits)
    logits -= frequency.unsqueeze(1) * output_counts
    logits -= presence.unsqueeze(1) * (output_counts > 0)
    return logits
