"""The contract between the engine and the worker: what the engine decided at start-up (`EngineSetup`),
what the scheduler hands the model runner each step (`SchedulerOutput`), the model inputs the runner
prepares from it (`StepArrays`, the same on every rank) and what the runner hands back (`StepResult`).

It lives in the worker, below the engine, so that imports point one way (docs/architecture.md, "Layers"):
the engine builds these objects and the worker reads them without importing the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from pagellm.core.attention import AttentionBackend, AttentionSpec
from pagellm.core.config import EngineConfig
from pagellm.core.kv_cache_spec import KVCacheLayout
from pagellm.core.kv_connector import KVConnectorOutput
from pagellm.core.platform import Platform
from pagellm.core.quant import QuantMethod
from pagellm.core.registry import Registry
from pagellm.core.selector import BackendChoice
from pagellm.sampling.params import SamplingParams


@dataclass
class ModelSource:
    """Where the model's files are."""

    directory: str  # a Hugging Face directory: config.json, tokenizer files, weights
    gguf_original: str | None = None  # the .gguf file the directory was converted from

    @property
    def gguf_file(self) -> str | None:
        return os.path.basename(self.gguf_original) if self.gguf_original else None


@dataclass
class EngineSetup:
    """Everything decided at start-up, before any weight is read."""

    config: EngineConfig
    registry: Registry
    platform: type[Platform]
    source: ModelSource
    hf_config: Any  # transformers.PretrainedConfig of the decoder (a multimodal checkpoint's text_config)
    model_class_path: str  # "module:Class" of the model, as registered for its architecture
    dtype: torch.dtype
    max_model_len: int
    spec: AttentionSpec  # the spec the backend was selected for: the most demanding layer's
    backend_choice: BackendChoice
    quant_method: type[QuantMethod] | None
    explanation: list[str] = field(default_factory=list)
    reasoning_parser: type | None = None  # --reasoning-parser's class (from the registry)
    # the layers' KV cache groups (core/kv_cache_spec.py); None: one group of every layer, with `spec`'s
    kv_layout: KVCacheLayout | None = None
    model_config: Any = None  # the checkpoint's whole config where it is not hf_config (multimodal)
    # the platform's kernels are building in the background: the engine starts without them (resolve_engine)
    kernels_pending: bool = False

    @property
    def backend(self) -> type[AttentionBackend]:
        return self.backend_choice.backend


class ScheduledRequest(Protocol):
    """What the runner reads of a scheduled request (the engine's `Request` provides it)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams  # None for a pooling request
    pooling_params: Any  # core.pooling.PoolingParams (pooling_type resolved) for a pooling request, else None
    num_computed_tokens: int  # position of its first scheduled token, during the step
    lora_request: Any  # lora.request.LoRARequest or None

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass
class SchedulerOutput:
    """One step's decision: which requests run and how many tokens each; also all the runner hears of
    requests (which are new or resumed, preempted, finished), by the engine's request ids."""

    scheduled: list[ScheduledRequest]  # batch order: running requests first, then newly admitted ones
    num_scheduled_tokens: dict[str, int]  # same order
    new_request_ids: set[str]  # scheduled for the first time or resumed after preemption
    preempted: list[str]  # preempted this step; their KV is gone
    finished_ids: set[str]  # finished or aborted since the previous step
    block_ids: dict[str, list[int]]  # each scheduled request's block table of KV cache group 0 (live lists)
    total_num_scheduled_tokens: int = 0
    # drafts to verify, by request id: they follow its known tokens and are counted in num_scheduled_tokens
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # structured output: int32 token bitmasks [1 + drafts, ceil(V / 32)] of requests with a grammar that
    # sample this step, by request id (row 0: after the last known token; row j: after draft j)
    grammar_bitmasks: dict[str, torch.Tensor] = field(default_factory=dict)
    # the KV connector's `build_connector_meta` for this step; None without a connector (or when a failed
    # step's requests rerun one by one: the step's transfers already ran)
    kv_connector_metadata: Any = None
    # each scheduled request's block tables, one per KV cache group (group 0's is `block_ids`'); when a
    # request is missing, it has group 0 only
    group_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)

    def block_tables(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block tables, one per KV cache group."""
        return self.group_block_ids.get(request_id) or (self.block_ids[request_id],)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepArrays:
    """One step's model inputs as host arrays, prepared by the driver's `ModelRunner._prepare_inputs` and
    sent to the other ranks as they are: every rank's forward reads only these. A new per-step model input
    (images, a recurrent state's slots) is a field here, filled there and read in `ModelRunner._forward`."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max blocks] int32, of KV cache group 0
    slot_mapping: np.ndarray  # [T] int64, of KV cache group 0
    # KV cache groups 1, 2, ... (the sliding-window layers of a hybrid model): each one's block tables and
    # slot mapping, shaped as the two above
    # [T] int64, for a length-dependent rope only: each token's request length max(prompt, position + 1)
    rope_lengths: np.ndarray | None = None
    more_groups: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
    # [B] int64, for a model with recurrent layers only: each request's state slot (its batch row)
    state_slots: np.ndarray | None = None
    # [B] int64, for a model with recurrent layers in a step that verifies drafts only: each request's rows
    # past its known tokens (the drafts), whose states the layers keep a way back from (`DraftReplay`)
    state_drafts: np.ndarray | None = None
    # [3, T] int64, for a multimodal rope only (Qwen-VL): each token's (temporal, height, width) position,
    # which the model reads in place of `positions`
    mrope_positions: np.ndarray | None = None
    # [S, 3] int64, for a model whose image tokens attend both ways only (Gemma 3): each of the step's images
    # as (request index, first position, end position), `AttentionBatch.bidirectional`
    bidirectional: np.ndarray | None = None
    # [B] int64: each request's row of the persistent batch (a proposer that reads the rows' tokens)
    batch_rows: np.ndarray | None = None

    def kv_groups(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every KV cache group's (block_tables, slot_mapping), group 0 first."""
        return [(self.block_tables, self.slot_mapping), *self.more_groups]


@dataclass
class StepResult:
    """What one step produced, by request id."""

    # the new tokens: with drafts verified, the accepted ones then the target's own
    sampled: dict[str, list[int]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts proposed for the next step
    # request id -> (token id -> (logprob, rank)) for the sampled token and the top-k, per new token
    logprobs: dict[str, list[dict[int, tuple[float, int]]]] = field(default_factory=dict)
    # request id -> one entry per prompt position computed this step (None for the first prompt token)
    prompt_logprobs: dict[str, list[dict[int, tuple[float, int]] | None]] = field(default_factory=dict)
    # pooling requests whose prompt ended this step: the pooled float32 vector [hidden] on the CPU
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None  # the KV connector's finished transfers
