"""The rejection sampler: which drafts the target model accepts, and the token it adds after them.

Logit rows come per request: its last known token, then each draft, so row j is the target's
distribution for the token after draft j. Greedy requests accept drafts while each equals the target's
argmax, then take the target's argmax (all accepted: the bonus token after the last draft). Sampling
requests use the accept/resample rule of Leviathan et al. with the draft certain (every proposer is
deterministic): accept draft d with probability p(d), else draw from p without d, renormalised, and
stop; all accepted, draw the bonus token from the last row. The output is distributed exactly as p.
A seeded request draws all its randomness from its own generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagellm.sampling.sampler import Sampler, SamplingBatch, argmax


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    batch: SamplingBatch,
    drafts: Sequence[Sequence[int]],
    greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
) -> list[list[int]]:
    """The new tokens of each request: its accepted drafts, then one token of the target's."""
    greedy_ids, probs = sampler.target(logits, batch)
    greedy_list = greedy_ids.tolist()
    out: list[list[int]] = []
    row = 0
    for draft, is_greedy, generator in zip(drafts, greedy, generators, strict=True):
        k = len(draft)
        if is_greedy or probs is None:
            targets = greedy_list[row : row + k + 1]
            j = 0
            while j < k and draft[j] == targets[j]:
                j += 1
            out.append(targets[: j + 1])
        else:
            out.append(_accept_or_resample(probs[row : row + k + 1], draft, generator or sampler.generator))
        row += k + 1
    return out


def _accept_or_resample(
    probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator | None
) -> list[int]:
    """All of a request's acceptance tests at once (k uniforms, one host sync), then one draw."""
    k = len(draft)
    accepted = 0
    if k:
        ids = torch.tensor(draft, device=probs.device)
        draft_probs = probs[:k].gather(1, ids.unsqueeze(1)).squeeze(1)
        uniforms = torch.rand(k, device=probs.device, generator=generator)
        accepted = int((uniforms < draft_probs).cumprod(0).sum())
    if accepted == k:
        return [*draft, _draw(probs[k], generator)]
    residual = probs[accepted].clone()
    residual[draft[accepted]] = 0.0
    return [*draft[:accepted], _draw(residual, generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn in proportion to `weights` (Gumbel-max with exponential noise, as the sampler)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int(argmax((weights / noise).unsqueeze(0))[0])
