"""The model runner's speculative decoding part (`speculative_config`): the proposer, which sees every
target forward (`observe`); the verification of a step's drafts (logits at the last known token and at
each draft, then the rejection sampler); and the drafts for the next step (`propose`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from pagellm.core.config import SpeculativeConfig
from pagellm.core.errors import ConfigError
from pagellm.sampling.sampler import Sampler, SamplingRequest, build_sampling_batch, compute_logprobs
from pagellm.spec_decode.draft_model import DraftModelProposer
from pagellm.spec_decode.eagle import make_eagle3_proposer
from pagellm.spec_decode.mtp import make_assistant_proposer, make_mtp_proposer
from pagellm.spec_decode.ngram import NgramProposer
from pagellm.spec_decode.proposer import DraftRequest, Proposer, StepInputs
from pagellm.spec_decode.rejection import verify
from pagellm.worker.input_batch import host_to_device
from pagellm.worker.logprobs import LogprobLists, row_logprobs
from pagellm.worker.step import ScheduledRequest, SchedulerOutput, StepResult

Rows = list[tuple[int, ScheduledRequest]]  # (index in the step's batch, request)


def make_proposer(
    speculative: SpeculativeConfig,
    draft: tuple | None,
    block_size: int,
    block_table: np.ndarray,
    device: torch.device,
) -> Proposer:
    """n-gram lookup, or the draft model (`draft`: its setup, model and KV caches) over the target's block
    tables (the runner's persistent batch), or an EAGLE-3 head or the MTP layer (`draft`: the target's setup,
    the head, its KV caches, the target model and the runner's persistent batch; for a Gemma 4 assistant
    the target's KV caches and its layers' KV cache groups in place of the head's caches)."""
    if speculative.method == "ngram":
        return NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
    if draft is None:
        raise ConfigError(f"speculative_config: {speculative.method} needs its model loaded with the target")
    if speculative.method == "eagle3":
        setup, head, kv_caches, target, batch = draft
        return make_eagle3_proposer(head, target, kv_caches, setup.backend, block_size, batch, device)
    if speculative.method == "mtp" and getattr(draft[1], "reads_target_kv", False):
        setup, head, (kv_caches, group_of), target, batch = draft
        return make_assistant_proposer(
            head, target, kv_caches, group_of, setup.backend, block_size, batch, device
        )
    if speculative.method == "mtp":
        setup, head, kv_caches, _, batch = draft
        return make_mtp_proposer(head, kv_caches, setup.backend, block_size, batch, device)
    setup, model, kv_caches = draft
    return DraftModelProposer(model, kv_caches, setup.backend, block_size, block_table, device)


class RunnerSpecDecode:
    def __init__(
        self,
        speculative: SpeculativeConfig,
        proposer: Proposer,
        max_model_len: int,
        sampler: Sampler,
        generators: Mapping[str, torch.Generator | None],
        eos_token_ids: set[int],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
    ):
        """`generators`: the runner's seeded generators by request id (kept current by the runner);
        `compute_logits`: the runner's, which the other tensor-parallel ranks follow."""
        self.speculative = speculative
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.sampler = sampler
        self.generators = generators
        self.eos_token_ids = eos_token_ids
        self.compute_logits = compute_logits
        self.device = device

    def observe(self, inputs: StepInputs) -> None:
        """After every target forward, eager or native (a draft model runs the same tokens, keeping its KV
        in step)."""
        self.proposer.observe(inputs)

    def verify(
        self, out: SchedulerOutput, hidden: torch.Tensor, sampling: Rows, cu: np.ndarray, result: StepResult
    ) -> None:
        """Logits at each sampling request's last known token and at each of its drafts, then the rejection
        sampler. Row j of a request sees its drafts before j as outputs (for penalties, min_tokens and logit
        bias), as if they were accepted, which they are when row j counts."""
        drafts = [out.spec_token_ids.get(r.request_id, []) for _, r in sampling]
        index, requests = [], []
        for (i, r), draft in zip(sampling, drafts, strict=True):
            end = int(cu[i + 1])
            index.extend(range(end - 1 - len(draft), end))
            outputs = list(r.output_token_ids)
            mask = out.grammar_bitmasks.get(r.request_id)
            for j in range(len(draft) + 1):
                generator = self.generators[r.request_id]
                allowed = mask[j] if mask is not None else None
                requests.append(
                    SamplingRequest(
                        r.sampling_params, r.prompt_token_ids, outputs + draft[:j], generator, allowed
                    )
                )
        rows = host_to_device(np.array(index, dtype=np.int64), self.device)
        logits = self.compute_logits(hidden.index_select(0, rows))
        batch = build_sampling_batch(requests, self.eos_token_ids, self.device)
        new_tokens = verify(
            self.sampler,
            logits,
            batch,
            drafts,
            [r.sampling_params.greedy for _, r in sampling],
            [self.generators[r.request_id] for _, r in sampling],
        )
        for (_, r), tokens in zip(sampling, new_tokens, strict=True):
            result.sampled[r.request_id] = tokens
        if batch.max_num_logprobs is None:
            return
        chosen = []
        for draft, tokens in zip(drafts, new_tokens, strict=True):
            chosen.extend(tokens + [0] * (len(draft) + 1 - len(tokens)))
        lp = LogprobLists.read(
            compute_logprobs(
                logits.float().log_softmax(dim=-1),
                host_to_device(np.array(chosen, dtype=np.int64), self.device),
                batch.max_num_logprobs,
            )
        )
        row = 0
        for (_, r), draft, tokens in zip(sampling, drafts, new_tokens, strict=True):
            k = r.sampling_params.logprobs
            if k is not None:
                result.logprobs[r.request_id] = [
                    row_logprobs(lp, row + j, k, t) for j, t in enumerate(tokens)
                ]
            row += len(draft) + 1

    def propose(self, sampling: Rows, rows: Mapping[str, int], result: StepResult) -> None:
        """Drafts for the next step of every request that got tokens now, within its max_tokens and the
        context (the scheduler drops those of requests that finished). `rows`: each request's row in the
        persistent batch."""
        k = self.speculative.num_speculative_tokens
        requests = []
        for _, r in sampling:
            tokens = r.all_token_ids + result.sampled[r.request_id]
            room = self.max_model_len - len(tokens)
            max_tokens = r.sampling_params.max_tokens
            if max_tokens is not None:  # the step after the drafts adds one token of its own
                room = min(room, max_tokens - (len(tokens) - r.num_prompt_tokens) - 1)
            if room > 0:
                requests.append(DraftRequest(r.request_id, tokens, min(k, room), rows[r.request_id]))
        if requests:
            for request, draft in zip(requests, self.proposer.propose(requests), strict=True):
                if draft:
                    result.spec_token_ids[request.request_id] = list(draft)
