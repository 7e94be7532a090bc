"""The model runner: loads the model, owns the KV cache, and runs one scheduled step.

Per step it gathers the flat batch (token ids, positions, slot mapping, block tables, query offsets)
from the persistent `InputBatch`, runs the model under the backend's metadata, computes logits only for
the positions that sample (or that asked for prompt logprobs), and samples on the device.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.core.attention import AttentionBatch
from pagellm.core.errors import ConfigError
from pagellm.core.kv_connector import (
    KVCacheBlocks,
    KVConnector,
    KVConnectorContext,
    KVConnectorOutput,
    KVConnectorRole,
    kv_block_dim,
    kv_namespace,
)
from pagellm.core.platform import GiB
from pagellm.core.transfer import to_device
from pagellm.distributed import Parallel
from pagellm.lora.manager import LoRAManager
from pagellm.lora.request import LoRARequest
from pagellm.models.base import ModelInit, rank_heads
from pagellm.models.context import LoRABatch, set_forward_context
from pagellm.models.layers.linear import Linear
from pagellm.models.loader import load_model, model_weight_bytes
from pagellm.sampling.params import MAX_LOGPROBS, SamplingParams
from pagellm.sampling.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingRequest,
    build_sampling_batch,
    compute_logprobs,
    compute_prompt_logprobs,
    make_generator,
)
from pagellm.spec_decode.draft_model import DraftModelProposer
from pagellm.spec_decode.ngram import NgramProposer
from pagellm.spec_decode.proposer import DraftRequest, Proposer, StepInputs
from pagellm.spec_decode.rejection import verify
from pagellm.worker.cuda_graphs import DecodeGraphs, capture_decode_graphs
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.pooler import PoolingState
from pagellm.worker.step import EngineSetup, SchedulerOutput, StepResult

logger = logging.getLogger("pagellm")


class ModelRunner:
    def __init__(
        self,
        setup: EngineSetup,
        weights: Iterable[tuple[str, torch.Tensor]],
        eos_token_ids: Iterable[int],
        draft: tuple[EngineSetup, Iterable[tuple[str, torch.Tensor]]] | None = None,
        parallel: Parallel | None = None,
    ):
        """`draft`: the draft model's setup and weights, for speculative decoding with a draft model.
        `parallel`: this rank's place when the model is split over several processes; every rank builds a
        runner, the driver (rank 0) runs `execute` and the others `serve`."""
        config = setup.config
        self.setup = setup
        self.parallel = parallel or Parallel()
        self.device = setup.platform.device(self.parallel.local_rank)
        if (
            self.parallel.world_size > 1 and self.device.type != "cpu"
        ):  # nccl and friends use the current device
            getattr(torch, self.device.type).set_device(self.device)
        self.block_size = config.block_size
        self.eos_token_ids = set(eos_token_ids)
        self.model_bytes = 0  # both models' weights as loaded (before the platform packs them)
        self.model = self._load(setup, weights)
        self.layers = _by_layer_idx(self.model.attention_layers())
        self.draft_setup = draft[0] if draft else None
        self.draft_model = self._load(*draft) if draft else None
        self.num_blocks = self.parallel.min(self._num_blocks())  # what fits on every rank
        self.kv_caches = self._kv_caches(setup, self.layers)
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager(
                self.model,
                config.max_loras,
                config.max_lora_rank,
                config.max_cpu_loras or config.max_loras,
                setup.dtype,
                self.device,
            )
        self.forward = self.model
        # the LoRA terms' row groups change every step; collectives stay out of compiled graphs
        if not config.enforce_eager and self.lora is None and self.parallel.world_size == 1:
            compiled = setup.platform.compile_model(self.model)
            if compiled is not None:
                self.forward = self._warm_up(compiled)
        self.input_batch = InputBatch(config.max_num_seqs, setup.max_model_len, self.block_size)
        self.generators: dict[str, torch.Generator | None] = {}
        self.pooling_states: dict[str, PoolingState] = {}  # pooling requests mid-prompt
        self.sampler = Sampler(
            torch.Generator(device=self.device).manual_seed(config.seed), argmax=setup.platform.argmax
        )
        self.speculative = config.speculative
        self.proposer: Proposer | None = self._make_proposer() if self.speculative else None
        # KV slots a proposer writes past a step's tokens: a draft model's own k - 1 steps ahead, and one more
        self.num_lookahead_tokens = self.speculative.num_speculative_tokens if self.draft_model else 0
        self.kv_connector: KVConnector | None = None  # the worker's half, with --kv-transfer-config
        self.kv_context: KVConnectorContext | None = None
        if config.kv_transfer is not None:
            self.kv_connector = self._make_kv_connector()
        self.graphs: DecodeGraphs | None = None  # decode steps replayed from CUDA graphs
        if self._uses_graphs():
            self.graphs = capture_decode_graphs(
                self.forward,
                setup.backend,
                self.kv_caches,
                self.layers,
                config.max_num_seqs,
                setup.max_model_len,
                self.block_size,
                self.device,
            )

    def _uses_graphs(self) -> bool:
        """CUDA graphs for decode steps where the platform and the backend allow them, unless
        --enforce-eager. Never with LoRA (each step's adapter rows differ), a split model (collectives),
        speculative decoding (the draft model reads every step's inputs) or a pooling runner (no decode)."""
        config = self.setup.config
        return (
            not config.enforce_eager
            and self.setup.platform.supports_cuda_graphs()
            and self.setup.backend.cuda_graph_decode
            and self.lora is None
            and self.parallel.world_size == 1
            and self.proposer is None
            and config.runner != "pooling"
        )

    def _load(self, setup: EngineSetup, weights: Iterable[tuple[str, torch.Tensor]]):
        quant = (
            setup.quant_method(getattr(setup.hf_config, "quantization_config", None))
            if setup.quant_method
            else None
        )
        init = ModelInit(
            setup.hf_config,
            setup.dtype,
            setup.backend,
            self.block_size,
            quant,
            setup.spec.kv_cache_dtype,
            self.parallel,
        )
        torch.set_default_dtype(setup.dtype)
        try:
            model = load_model(setup.model_class_path, init, weights, self.device)
        finally:
            torch.set_default_dtype(torch.float32)
        self.model_bytes += model_weight_bytes(model)
        self._pack_linears(model)
        return model

    def _kv_caches(self, setup: EngineSetup, layers: list) -> list[torch.Tensor]:
        """One cache per attention layer, by layer_idx; an empty tensor for another pipeline stage's."""
        spec = rank_heads(setup.spec, self.parallel.tp)
        shape = setup.backend.kv_cache_shape(
            self.num_blocks, self.block_size, spec.num_kv_heads, spec.cache_row_size
        )
        empty = torch.empty(0, dtype=spec.cache_dtype, device=self.device)
        return [
            torch.zeros(shape, dtype=spec.cache_dtype, device=self.device) if layer is not None else empty
            for layer in layers
        ]

    def _make_proposer(self) -> Proposer:
        spec = self.speculative
        if spec.method == "ngram":
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        if self.draft_model is None:
            raise ConfigError("speculative_config: draft_model needs the draft model loaded with the target")
        draft_caches = self._kv_caches(self.draft_setup, self.draft_model.attention_layers())
        return DraftModelProposer(
            self.draft_model,
            draft_caches,
            self.draft_setup.backend,
            self.block_size,
            self.input_batch.block_table,
            self.device,
        )

    def _pack_linears(self, model) -> None:
        """Let the platform prepack every plain linear layer's weight (`Platform.pack_linear`), and the
        output projection's for `CausalLM.project_logits`. A tied lm_head is the embedding, which needs its
        plain weight too, so it gets a packed copy (memory: the vocab x hidden weight once more)."""
        lm_head = getattr(model, "lm_head", None)
        for module in model.modules():
            if isinstance(module, Linear) and module.quant_method is None and module is not lm_head:
                module.use_packed(self.setup.platform.pack_linear(module.weight))
        if lm_head is None or getattr(lm_head, "quant_method", None) is not None:
            return
        packed = self.setup.platform.pack_linear(lm_head.weight)
        if packed is not None:
            model.packed_lm_head = packed
            if isinstance(lm_head, Linear):
                lm_head.use_packed(packed)

    @torch.inference_mode()
    def _warm_up(self, compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Compile now rather than in the first request's step: one token and two (compilers specialise
        size 1), each a prompt that stores nothing. Returns the eager model, with a warning, on failure."""
        started = time.monotonic()
        try:
            for num_tokens in (1, 2):
                attn = _dummy_prefill(num_tokens, self.block_size, self.device)
                with set_forward_context(
                    self.setup.backend.build_metadata(attn), self.kv_caches, self.layers
                ):
                    compiled(
                        torch.zeros(num_tokens, dtype=torch.long, device=self.device),
                        torch.arange(num_tokens, device=self.device),
                    )
        except Exception as e:  # an inductor or compiler failure: slower, not broken
            logger.warning("compiling the model failed, running it eagerly: %s: %s", type(e).__name__, e)
            return self.model
        logger.info("model compiled in %.1fs (--enforce-eager turns this off)", time.monotonic() - started)
        return compiled

    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers, the draft model's included."""
        total = 0
        for setup, model in ((self.setup, self.model), (self.draft_setup, self.draft_model)):
            if model is None:
                continue
            spec = rank_heads(setup.spec, self.parallel.tp)
            shape = setup.backend.kv_cache_shape(1, self.block_size, spec.num_kv_heads, spec.cache_row_size)
            elem = torch.empty((), dtype=spec.cache_dtype).element_size()
            total += int(np.prod(shape)) * elem * len(model.attention_layers())
        return total

    def _num_blocks(self) -> int:
        config = self.setup.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        platform = self.setup.platform
        index = self.device.index or 0
        peak = self._profile_memory(index)
        if peak is None:
            peak = platform.memory_in_use(self.model_bytes, index)
        budget = platform.kv_cache_bytes(config, self.model_bytes, peak)
        num_blocks = budget // self.block_bytes()
        if num_blocks < 2:
            raise ConfigError(
                f"no memory left for the KV cache ({budget / GiB:.2f} GiB after the model's "
                f"{self.model_bytes / GiB:.2f} GiB); raise --kv-cache-space or --gpu-memory-utilization"
            )
        # no more than max_num_seqs full contexts can use (plus the null block): on a large accelerator the
        # memory alone would make millions of blocks, each a start-up cost
        per_request = -(-(self.setup.max_model_len + self.block_size) // self.block_size)
        num_blocks = int(min(num_blocks, config.max_num_seqs * per_request + 1))
        logger.info(
            "KV cache budget (rank %d): %.2f GiB, %d blocks", self.parallel.rank, budget / GiB, num_blocks
        )
        return num_blocks

    @torch.inference_mode()
    def _profile_memory(self, index: int) -> int | None:
        """Bytes of the device the KV cache must leave free, profiled as vLLM does: torch's allocator peak
        over a dummy step at the largest size (the weights and the step's activations) plus the memory in
        use outside the allocator. None where the platform keeps no peak counter (the cpu platform sizes
        the cache by --kv-cache-space).

        The step is a prompt of the scheduler's token budget that stores nothing, then the logits and the
        sampler (top-k, top-p, min-p and logprobs: its largest buffers) on max_num_seqs rows (times the
        tokens a speculative verify step scores). Every rank runs it at once, so the model's collectives
        pair up, and measures its own part."""
        platform = self.setup.platform
        if platform.peak_memory_allocated(index) is None:
            return None
        config = self.setup.config
        # the scheduler's token budget (LLMEngine._scheduler, Scheduler.token_budget): its largest step
        num_tokens = config.token_budget
        if not config.enable_chunked_prefill:
            num_tokens = max(num_tokens, self.setup.max_model_len)
        spec = rank_heads(self.setup.spec, self.parallel.tp)
        shape = self.setup.backend.kv_cache_shape(1, self.block_size, spec.num_kv_heads, spec.cache_row_size)
        cache = torch.zeros(shape, dtype=spec.cache_dtype, device=self.device)  # block 0, read, never written
        if self.parallel.world_size > 1:
            # ranks load at their own pace, and the step's collectives time out sooner than start-up's
            torch.distributed.barrier(group=self.parallel.startup)
        platform.synchronize()
        platform.reset_peak_memory(index)
        before = platform.peak_memory_allocated(index)
        attn = _dummy_prefill(num_tokens, self.block_size, self.device)
        with set_forward_context(
            self.setup.backend.build_metadata(attn), [cache] * len(self.layers), self.layers
        ):
            hidden = self.model(
                torch.zeros(num_tokens, dtype=torch.long, device=self.device),
                torch.arange(num_tokens, device=self.device),
            )
        if config.runner == "generate" and getattr(self.model, "lm_head", None) is not None:
            speculative = config.speculative  # a verify step takes logits of every draft and the bonus token
            num_rows = config.max_num_seqs * (1 + (speculative.num_speculative_tokens if speculative else 0))
            rows = torch.arange(num_rows, device=self.device) % num_tokens
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            if self.parallel.is_driver:  # only the driver samples
                params = SamplingParams(top_k=50, top_p=0.9, min_p=0.01, logprobs=MAX_LOGPROBS)
                requests = [SamplingRequest(params, [0], [])] * num_rows
                batch = build_sampling_batch(requests, self.eos_token_ids, self.device)
                Sampler(torch.Generator(device=self.device))(logits, batch)
        platform.synchronize()
        peak, outside = platform.peak_memory_allocated(index), platform.non_torch_memory(index)
        logger.info(
            "memory profile (rank %d): weights %.2f GiB, activation peak %.2f GiB (%d tokens), outside "
            "torch's allocator %.2f GiB",
            self.parallel.rank,
            self.model_bytes / GiB,
            (peak - before) / GiB,
            num_tokens,
            outside / GiB,
        )
        return peak + outside

    def add_lora(self, request: LoRARequest) -> None:
        """Load an adapter into memory (ConfigError when LoRA is off or the adapter cannot run)."""
        if self.lora is None:
            raise ConfigError("a request names a LoRA adapter, but LoRA is off; start with enable_lora=True")
        self.lora.add(request)

    def add_requests(self, params: Mapping[str, SamplingParams]) -> None:
        """Create new requests' own state (a seeded generator) when they are added, not in a step: a
        failure is then theirs alone and comes before they are queued."""
        generators = {request_id: make_generator(p, self.device) for request_id, p in params.items()}
        self.generators.update(generators)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop per-request state of finished or preempted requests."""
        for request_id in request_ids:
            self.input_batch.remove(request_id)
            self.pooling_states.pop(request_id, None)  # a preempted request pools its prompt again

    def release(self, request_ids: Iterable[str]) -> None:
        """Drop everything of finished requests, their seeded generator included."""
        for request_id in request_ids:
            self.input_batch.remove(request_id)
            self.generators.pop(request_id, None)
            self.pooling_states.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        if out.kv_connector_metadata is not None:  # loads go into blocks no request of this step reads
            self.kv_connector.bind_connector_metadata(out.kv_connector_metadata)
            self.kv_connector.start_load_kv()
        if out.is_empty:  # only transfers to run
            return StepResult(kv_connector_output=self._kv_done(out))
        batch = self.input_batch
        rows, counts, starts = [], [], []
        sampling, prompt_lp, pooling = [], [], []  # (index in batch, request)
        for i, request in enumerate(out.scheduled):
            rid = request.request_id
            row = batch.row(rid)
            batch.sync(row, request.all_token_ids, out.block_ids[rid])
            drafts = out.spec_token_ids.get(rid, ())
            if drafts:  # after the known tokens; the next sync overwrites them with the accepted ones
                batch.token_ids[row, request.num_tokens : request.num_tokens + len(drafts)] = drafts
            n = out.num_scheduled_tokens[rid]
            start = request.num_computed_tokens
            rows.append(row)
            counts.append(n)
            starts.append(start)
            if request.pooling_params is not None:  # embeddings: pooled, never sampled
                pooling.append((i, request))
                continue
            if start + n == request.num_tokens + len(drafts):
                sampling.append((i, request))
            if request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens:
                prompt_lp.append((i, request))
        counts_np = np.asarray(counts, dtype=np.int64)
        cu = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts_np, out=cu[1:])
        num_tokens = int(cu[-1])
        token_rows = np.repeat(np.asarray(rows, dtype=np.int64), counts_np)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1] - np.asarray(starts), counts_np)
        bs = self.block_size
        seq_lens = np.asarray(starts, dtype=np.int64) + counts_np
        step = StepArrays(
            input_ids=batch.token_ids[token_rows, positions],
            positions=positions,
            query_start_loc=cu.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            block_tables=batch.block_table[rows, : int(-(-seq_lens.max() // bs))],
            slot_mapping=batch.block_table[token_rows, positions // bs].astype(np.int64) * bs
            + positions % bs,
        )
        lora = self._lora_batch(out.scheduled, cu) if self.lora is not None else None
        if self.parallel.world_size > 1:
            self.parallel.broadcast(("forward", step))
        hidden = self.graphs.run(step) if self.graphs is not None else None
        if hidden is None:
            input_ids_dev, positions_dev, attn, hidden = self._forward(step, lora)
            if self.proposer is not None:
                self.proposer.observe(StepInputs(input_ids_dev, positions_dev, attn, hidden))
        result = StepResult(kv_connector_output=self._kv_done(out))
        if pooling:
            self._pool(hidden, pooling, cu, starts, result)
        if prompt_lp:
            self._prompt_logprobs(hidden, prompt_lp, cu, starts, result)
        if not sampling:
            return result
        if out.spec_token_ids:
            self._verify(out, hidden, sampling, cu, result)
        else:
            self._sample(out, hidden, sampling, cu, result)
        if self.proposer is not None:
            self._propose(sampling, result)
        return result

    def _kv_done(self, out: SchedulerOutput) -> KVConnectorOutput | None:
        """After the forward: the connector saves what the step computed, then reports finished transfers."""
        connector = self.kv_connector
        if out.kv_connector_metadata is None:
            return None
        connector.wait_for_save()
        sending, recving = connector.get_finished(out.finished_ids)
        output = KVConnectorOutput(sending, recving, connector.get_block_ids_with_load_errors())
        connector.clear_connector_metadata()
        return output

    def _make_kv_connector(self) -> KVConnector:
        """The connector's worker half over this runner's KV caches. Its namespace names the model and the
        KV layout, so KV saved by another model or layout is never loaded here."""
        import uuid

        setup, transfer = self.setup, self.setup.config.kv_transfer
        spec = rank_heads(setup.spec, self.parallel.tp)
        shape = setup.backend.kv_cache_shape
        block_dim = kv_block_dim(shape, self.block_size, spec.num_kv_heads, spec.cache_row_size)
        namespace = kv_namespace(
            os.path.realpath(setup.source.directory),
            setup.source.gguf_file,
            str(setup.dtype),
            str(spec.cache_dtype),
            self.block_size,
            tuple(shape(1, self.block_size, spec.num_kv_heads, spec.cache_row_size)),
            len(self.kv_caches),
            setup.quant_method.name if setup.quant_method else None,
        )
        self.kv_context = KVConnectorContext(
            self.block_size, namespace, transfer.engine_id or uuid.uuid4().hex[:12]
        )
        connector = setup.registry.kv_connectors[transfer.kv_connector](
            transfer, KVConnectorRole.WORKER, self.kv_context
        )
        connector.register_kv_caches(KVCacheBlocks(self.kv_caches, block_dim))
        return connector

    def _forward(self, step: StepArrays, lora: LoRABatch | None = None):
        """Run the model on one step's arrays: (input ids, positions, attention batch, hidden states)."""
        attn = AttentionBatch(
            query_start_loc=self._dev(step.query_start_loc),
            seq_lens=self._dev(step.seq_lens),
            block_tables=self._dev(step.block_tables),
            slot_mapping=self._dev(step.slot_mapping),
            query_start_loc_cpu=torch.from_numpy(step.query_start_loc),
            seq_lens_cpu=torch.from_numpy(step.seq_lens),
            max_query_len=int(np.diff(step.query_start_loc).max()),
            max_seq_len=int(step.seq_lens.max()),
        )
        metadata = self.setup.backend.build_metadata(attn)
        input_ids, positions = self._dev(step.input_ids), self._dev(step.positions)
        with set_forward_context(metadata, self.kv_caches, self.layers, lora):
            hidden = self.forward(input_ids, positions)
        return input_ids, positions, attn, hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits for these hidden states; with tensor parallelism every rank computes its part
        of the vocabulary, so the driver first sends them the rows."""
        if self.parallel.tp.size > 1:
            self.parallel.broadcast(("logits", hidden.cpu()))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def serve(self) -> None:
        """The loop of a rank other than the driver: run what the driver sends until it says stop."""
        while True:
            op, payload = self.parallel.broadcast()
            if op == "forward":
                self._forward(payload)
            elif op == "logits":
                if self.model.lm_head is not None:  # the first pipeline stage's ranks hold the vocabulary
                    self.model.compute_logits(payload.to(self.device))
            else:
                return

    def stop_ranks(self) -> None:
        """Tell the other ranks' `serve` loops to return (driver only)."""
        if self.parallel.world_size > 1 and self.parallel.is_driver:
            self.parallel.broadcast(("stop", None))

    def _lora_batch(self, scheduled, cu) -> LoRABatch | None:
        """The step's adapter tokens and their slots; None when every request runs the base model."""
        slots = self.lora.activate(r.lora_request for r in scheduled if r.lora_request is not None)
        if not slots:
            return None
        rows, row_slots = [], []
        for i, r in enumerate(scheduled):
            if r.lora_request is not None:
                rows.append(np.arange(cu[i], cu[i + 1]))
                row_slots.append(np.full(cu[i + 1] - cu[i], slots[r.lora_request.lora_int_id]))
        return LoRABatch(
            self._dev(np.concatenate(rows)), self._dev(np.concatenate(row_slots)), self.lora.max_loras
        )

    def _sample(self, out: SchedulerOutput, hidden, sampling, cu, result: StepResult) -> None:
        index = self._dev(np.array([cu[i + 1] - 1 for i, _ in sampling], dtype=np.int64))
        logits = self.compute_logits(hidden.index_select(0, index))
        masks = out.grammar_bitmasks
        requests = [
            SamplingRequest(
                r.sampling_params,
                r.prompt_token_ids,
                r.output_token_ids,
                self.generators[r.request_id],
                masks[r.request_id][0] if r.request_id in masks else None,
            )
            for _, r in sampling
        ]
        sampled = self.sampler(logits, build_sampling_batch(requests, self.eos_token_ids, self.device))
        token_ids = sampled.token_ids.tolist()
        for j, (_, request) in enumerate(sampling):
            result.sampled[request.request_id] = [token_ids[j]]
        if sampled.logprobs is not None:
            lp = _LogprobLists.read(sampled.logprobs)
            for j, (_, request) in enumerate(sampling):
                k = request.sampling_params.logprobs
                if k is not None:
                    result.logprobs[request.request_id] = [_row_logprobs(lp, j, k, token_ids[j])]

    def _verify(self, out: SchedulerOutput, hidden, sampling, cu, result: StepResult) -> None:
        """Speculative decoding: logits at each sampling request's last known token and at each of its
        drafts, then the rejection sampler. Row j of a request sees its drafts before j as outputs (for
        penalties, min_tokens and logit bias), as if they were accepted, which they are when row j counts."""
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
        logits = self.compute_logits(hidden.index_select(0, self._dev(np.array(index, dtype=np.int64))))
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
        chosen, row = [], 0
        for draft, tokens in zip(drafts, new_tokens, strict=True):
            chosen.extend(tokens + [0] * (len(draft) + 1 - len(tokens)))
            row += len(draft) + 1
        lp = _LogprobLists.read(
            compute_logprobs(
                logits.float().log_softmax(dim=-1),
                self._dev(np.array(chosen, dtype=np.int64)),
                batch.max_num_logprobs,
            )
        )
        row = 0
        for (_, r), draft, tokens in zip(sampling, drafts, new_tokens, strict=True):
            k = r.sampling_params.logprobs
            if k is not None:
                result.logprobs[r.request_id] = [
                    _row_logprobs(lp, row + j, k, t) for j, t in enumerate(tokens)
                ]
            row += len(draft) + 1

    def _propose(self, sampling, result: StepResult) -> None:
        """Drafts for the next step of every request that got tokens now, within its max_tokens and the
        context (the scheduler drops those of requests that finished)."""
        k = self.speculative.num_speculative_tokens
        requests = []
        for _, r in sampling:
            tokens = r.all_token_ids + result.sampled[r.request_id]
            room = self.setup.max_model_len - len(tokens)
            max_tokens = r.sampling_params.max_tokens
            if max_tokens is not None:  # the step after the drafts adds one token of its own
                room = min(room, max_tokens - (len(tokens) - r.num_prompt_tokens) - 1)
            if room > 0:
                requests.append(
                    DraftRequest(r.request_id, tokens, min(k, room), self.input_batch.rows[r.request_id])
                )
        if requests:
            for request, draft in zip(requests, self.proposer.propose(requests), strict=True):
                if draft:
                    result.spec_token_ids[request.request_id] = list(draft)

    def _pool(self, hidden, pooling, cu, starts, result: StepResult) -> None:
        """Feed each pooling request's rows to its `PoolingState`; a prompt that ends in this step gets its
        pooled float32 vector (on the CPU) in `result.pooled`."""
        for i, request in pooling:
            rid = request.request_id
            state = self.pooling_states.setdefault(rid, PoolingState())
            rows = hidden[int(cu[i]) : int(cu[i + 1])]
            vector = state.add(request.pooling_params.pooling_type, rows, starts[i], request.num_tokens)
            if vector is not None:
                result.pooled[rid] = vector.cpu()
                del self.pooling_states[rid]

    def _prompt_logprobs(self, hidden, prompt_lp, cu, starts, result: StepResult) -> None:
        """Logprobs of the prompt tokens this step's rows predict (position p predicts token p + 1), for
        all the requests that asked at once: one logits computation and one read to the host."""
        rows, targets, counts = [], [], []
        for i, request in prompt_lp:
            start = starts[i]
            end = min(start + int(cu[i + 1] - cu[i]), request.num_prompt_tokens)
            last = min(end, request.num_prompt_tokens - 1)
            count = max(last - start, 0)
            rows.append(np.arange(cu[i], cu[i] + count))
            targets += request.prompt_token_ids[start + 1 : start + 1 + count]
            counts.append(count)
        lp = None
        if targets:
            k = max(request.sampling_params.prompt_logprobs for _, request in prompt_lp)
            logits = self.compute_logits(hidden.index_select(0, self._dev(np.concatenate(rows))))
            tensors = compute_prompt_logprobs(logits, self._dev(np.array(targets, dtype=np.int64)), k)
            lp = _LogprobLists.read(tensors)
        row = 0
        for (i, request), count in zip(prompt_lp, counts, strict=True):
            k = request.sampling_params.prompt_logprobs
            entries: list = [None] if starts[i] == 0 else []
            entries += [_row_logprobs(lp, row + j, k, targets[row + j]) for j in range(count)]
            row += count
            result.prompt_logprobs[request.request_id] = entries

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device, through page-locked memory where the device has it (so the host
        does not wait, and the array may change right after); on the CPU the array's own memory."""
        return to_device(torch.from_numpy(np.ascontiguousarray(array)), self.device)


@dataclass
class StepArrays:
    """One step's model inputs as host arrays: what the driver sends the other ranks."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max blocks] int32
    slot_mapping: np.ndarray  # [T] int64


def _by_layer_idx(layers: list) -> list:
    """Attention layers at their layer_idx, None where another pipeline stage holds the layer."""
    table = [None] * (max((layer.layer_idx for layer in layers), default=-1) + 1)
    for layer in layers:
        table[layer.layer_idx] = layer
    return table


def _dummy_prefill(num_tokens: int, block_size: int, device: torch.device) -> AttentionBatch:
    """A one-request step of `num_tokens` new tokens that reads no cache and stores nothing (slot -1)."""
    query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int32)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
    return AttentionBatch(
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        block_tables=torch.zeros(1, -(-num_tokens // block_size), dtype=torch.int32, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )


@dataclass
class _LogprobLists:
    """A step's `LogprobsTensors` read to the host once, as lists (one transfer per tensor, not one per
    element: each read of a device tensor waits for the device)."""

    token_logprobs: list[float]
    token_ranks: list[int]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]

    @classmethod
    def read(cls, t: LogprobsTensors) -> _LogprobLists:
        return cls(
            t.token_logprobs.tolist(), t.token_ranks.tolist(), t.topk_ids.tolist(), t.topk_logprobs.tolist()
        )


def _row_logprobs(lp: _LogprobLists, row: int, k: int, token_id: int) -> dict[int, tuple[float, int]]:
    """The chosen token first, then the top k: token id -> (logprob, rank)."""
    entry = {token_id: (lp.token_logprobs[row], lp.token_ranks[row])}
    for j, (top_id, top_logprob) in enumerate(
        zip(lp.topk_ids[row][:k], lp.topk_logprobs[row][:k], strict=True)
    ):
        entry.setdefault(top_id, (top_logprob, j + 1))
    return entry
