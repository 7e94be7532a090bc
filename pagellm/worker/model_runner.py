"""The model runner: loads the model, owns the KV cache, and runs one scheduled step.

It hears of requests only from each step's `SchedulerOutput` (`_update_states`, first in `execute`). Then a
step is three jobs, one method each: `_prepare_inputs` brings the persistent `InputBatch` up to date and
gathers the flat `StepArrays` (token ids, positions, slot mapping, block tables, query offsets) and which
rows sample, pool or want prompt logprobs (`PreparedStep`); `_run_model` runs the forward on them (every
rank; a replayed CUDA graph where one fits); then the outputs: pooled vectors, prompt logprobs, and logits
of only the rows that sample, sampled on the device.

The optional parts are helpers the runner holds, each None when off: `lora` (`runner_lora.py`),
`kv_transfer` (`runner_kv_connector.py`), `spec_decode` (`runner_spec_decode.py`) and `graphs`
(`cuda_graphs.py`). The KV cache's layout and size are `kv_cache.py`'s; with several KV cache groups
(`core/kv_cache_spec.py`: layers with different sliding windows) each group has its own block tables,
slot mapping and attention metadata, and each layer runs with its group's.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from pagellm.core.attention import AttentionBatch
from pagellm.core.errors import ConfigError
from pagellm.core.kv_cache_spec import blocks_per_request
from pagellm.core.kv_connector import KVConnector, KVConnectorContext, KVConnectorOutput
from pagellm.core.platform import GiB
from pagellm.distributed import Parallel
from pagellm.lora.request import LoRARequest
from pagellm.models.base import ModelInit
from pagellm.models.context import ImageBatch, LoRABatch, StateBatch, set_forward_context
from pagellm.models.layers.fused_moe.layer import FusedMoE, place_mxfp4_experts
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.recurrent import RecurrentLayer
from pagellm.models.layers.rotary import request_length_base
from pagellm.models.loader import load_model, model_weight_bytes
from pagellm.sampling.params import MAX_LOGPROBS, SamplingParams
from pagellm.sampling.sampler import (
    Sampler,
    SamplingRequest,
    build_sampling_batch,
    compute_prompt_logprobs,
    make_generator,
)
from pagellm.spec_decode.proposer import StepInputs
from pagellm.worker.cuda_graphs import DecodeGraphs, capture_decode_graphs, decode_graphs_allowed
from pagellm.worker.encoder_cache import EncoderCache
from pagellm.worker.input_batch import (
    InputBatch,
    PreparedStep,
    host_to_device,
    image_spans,
    mrope_positions,
)
from pagellm.worker.kv_cache import (
    allocate_kv_caches,
    blocks_in_budget,
    kv_block_bytes,
    kv_cache_shape,
    kv_layout,
    num_kv_tensors,
    rank_spec,
)
from pagellm.worker.logprobs import LogprobLists, row_logprobs
from pagellm.worker.pooler import PoolingState
from pagellm.worker.runner_compile import CoreYield, RunnerCompile, dummy_prefill
from pagellm.worker.runner_kv_connector import RunnerKVConnector
from pagellm.worker.runner_lora import RunnerLoRA
from pagellm.worker.runner_spec_decode import RunnerSpecDecode, make_proposer
from pagellm.worker.state_cache import allocate_states
from pagellm.worker.step import EngineSetup, SchedulerOutput, StepArrays, StepResult

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
        self.device = self._bind_device()
        self.block_size = config.block_size
        self.eos_token_ids = set(eos_token_ids)
        self.model_bytes = 0  # both models' weights as loaded (before the platform packs them)
        self.cores = CoreYield()
        if setup.kernels_pending:
            self.cores.yield_one()  # to the kernels' build, from the load on
        self.model = self._load(setup, weights)
        self.layers = _by_layer_idx(self.model.attention_layers())
        self.rope_length_base = request_length_base(self.model)  # models/layers/rotary.py
        num_layers = getattr(setup.hf_config, "num_hidden_layers", None) or len(self.layers)
        self.kv_layout = kv_layout(setup, num_layers)
        # each layer's KV cache group, by layer_idx (None: one group)
        self.layer_groups = (
            [self.kv_layout.group_of(i) for i in range(len(self.layers))]
            if self.kv_layout.num_groups > 1
            else None
        )
        self.draft_setup = draft[0] if draft else None
        self.draft_model = self._load(*draft) if draft else None
        self.state_layers = self.model.state_layers()
        self.max_num_seqs = self._check_state_layers()
        self.num_blocks = self.parallel.min(self._num_blocks())  # what fits on every rank
        self.kv_caches = allocate_kv_caches(
            setup,
            self.parallel.tp,
            self.layers,
            self.num_blocks,
            self.block_size,
            self.device,
            self.kv_layout,
        )
        self.lora = RunnerLoRA(self.model, config, setup.dtype, self.device) if config.enable_lora else None
        self.kernels_pending = setup.kernels_pending  # until `_take_up_kernels`
        self.compiler = RunnerCompile(
            self.model,
            setup,
            self.kv_caches,
            self.layers,
            self.device,
            guard_free=not (
                self.state_layers
                or getattr(self.model, "supports_images", False)
                or getattr(self.model, "uses_mrope", False)
                or self.rope_length_base is not None
            ),
            blocks_of_one_request=blocks_per_request(
                self.kv_windows(), self.block_size, setup.max_model_len + self.block_size, 1
            ),
            cores=self.cores,
        )
        self.forward = self._compile()
        # a recurrent layer's state slot is its request's row here (core/state.py)
        self.state_caches = allocate_states(self.state_layers, self.max_num_seqs, self.device)
        # a model that takes images: its encoder's outputs between the steps of a prefill
        self.encoder_cache = None
        if getattr(self.model, "supports_images", False):
            # the vision encoder is compiled where the text model is
            compile_with = self.setup.platform.compile_model if self.forward is not self.model else None
            self.encoder_cache = EncoderCache(self.model, self.device, compile_with)
        self.uses_mrope = bool(getattr(self.model, "uses_mrope", False))
        self.bidirectional_images = bool(getattr(self.model, "bidirectional_images", False))
        self.recurrent_kernels = setup.platform.recurrent_kernels()
        if self.state_layers:
            logger.info("recurrent layers' kernels: %s", self.recurrent_kernels.describe())
        self.input_batch = InputBatch(
            self.max_num_seqs, setup.max_model_len, self.block_size, self.kv_layout.num_groups
        )
        self.generators: dict[str, torch.Generator | None] = {}
        self.pooling_states: dict[str, PoolingState] = {}  # pooling requests mid-prompt
        self.sampler = Sampler(
            torch.Generator(device=self.device).manual_seed(config.seed), argmax=setup.platform.argmax
        )
        self.spec_decode = self._make_spec_decode() if config.speculative else None
        # KV slots a proposer writes past a step's tokens: a draft model's own k - 1 steps ahead, and one more
        self.num_lookahead_tokens = config.speculative.num_speculative_tokens if self.draft_model else 0
        self.kv_transfer = (
            RunnerKVConnector(setup, self.parallel.tp, self.kv_caches, self.block_size)
            if config.kv_transfer is not None
            else None
        )
        self.graphs = self._capture_graphs()  # decode steps replayed from CUDA graphs
        if self.kv_windows() != self.kv_layout.windows:
            logger.info(
                "KV cache: sliding-window layers keep every block (%s)",
                "a KV connector moves whole block tables"
                if config.kv_transfer is not None
                else "the draft model reads group 0's block table",
            )

    # -- start-up -----------------------------------------------------------------------------------------

    def _bind_device(self) -> torch.device:
        """This rank's device; with several ranks also the current one (nccl and friends use it)."""
        device = self.setup.platform.device(self.parallel.local_rank)
        if self.parallel.world_size > 1 and device.type != "cpu":
            getattr(torch, device.type).set_device(device)
        return device

    def _load(self, setup: EngineSetup, weights: Iterable[tuple[str, torch.Tensor]]):
        """Build a model (the target or the draft) on the device, load its weights, pack its linears."""
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
            setup.config.enable_expert_parallel,
            setup.model_config,
            setup.config.batch_invariant,
        )
        torch.set_default_dtype(setup.dtype)
        try:
            model = load_model(setup.model_class_path, init, weights, self.device)
        finally:
            torch.set_default_dtype(torch.float32)
        place_mxfp4_experts(model, self.setup.platform)  # before counting: what stays in memory
        self.model_bytes += model_weight_bytes(model)
        if not setup.kernels_pending:  # else packed when the kernels are built (`_take_up_kernels`)
            self._pack_linears(model)
            self._pack_experts(model)
        if setup.config.batch_invariant:
            check_batch_invariant(model)
        return model

    def _pack_linears(self, model) -> None:
        """Let the platform prepack every plain linear layer's weight (`Platform.pack_linear`), and the
        output projection's for `CausalLM.project_logits`. A tied lm_head is the embedding, which needs its
        plain weight too, so it gets a packed copy (memory: the vocab x hidden weight once more)."""
        lm_head = getattr(model, "lm_head", None)
        pack = self.setup.platform.pack_linear
        if self.setup.config.batch_invariant:
            pack = functools.partial(pack, batch_invariant=True)
        for module in model.modules():
            if (
                isinstance(module, Linear)
                and module.quant_method is None
                and module is not lm_head
                and module.weight is not None  # not packed already
            ):
                module.use_packed(pack(module.weight))
        if (
            lm_head is None
            or getattr(lm_head, "quant_method", None) is not None
            or model.packed_lm_head is not None  # the quantization method packed it (GGUF blocks)
        ):
            return
        packed = pack(lm_head.weight)
        if packed is not None:
            model.packed_lm_head = packed
            if isinstance(lm_head, Linear):
                lm_head.use_packed(packed)

    def _pack_experts(self, model) -> None:
        """Hand every MoE layer's stacked experts to the platform's kernel (`Platform.pack_moe`), unless the
        quantization method's kernel runs them already (GGUF blocks, MXFP4 blocks: `place_mxfp4_experts`); a
        layer the platform packs nothing for runs `fused_experts_reference`. Says once which runs them."""
        layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
        paths = set()
        for layer in (m for m in layers if m.packed is None):
            layer.use_packed(
                self.setup.platform.pack_moe(
                    layer.w13,
                    layer.w2,
                    layer.w13_bias,
                    layer.w2_bias,
                    layer.activation,
                    w13_scale=layer.w13_scale,
                    w2_scale=layer.w2_scale,
                )
            )
        for layer in layers:
            paths.add(layer.packed.description if layer.packed is not None else "the PyTorch reference")
        if layers:
            logger.info("MoE experts of %d layers run on %s", len(layers), ", ".join(sorted(paths)))

    def _compile(self) -> Callable[..., torch.Tensor]:
        """The compiled forward (`RunnerCompile`); the eager model with --enforce-eager, LoRA (the LoRA
        terms' row groups change every step) or a split model (collectives stay out of compiled graphs),
        and while the platform's kernels build (the graph calls them: compiled after `_take_up_kernels`)."""
        config = self.setup.config
        if config.enforce_eager or self.lora is not None or self.parallel.world_size > 1:
            return self.model
        if self.kernels_pending:
            self.compiler.yield_a_core()  # the build's, as a compile process's
            return self.model
        return self.compiler.forward()

    def _take_up_kernels(self) -> None:
        """Between two steps, once the kernels building in the background are built (or failed: then what
        is done here changes nothing): what a quantization method loaded another way meanwhile put back on
        them (`QuantMethod.take_up_kernels`: a GGUF file's widened blocks, its experts: `FusedMoE.
        take_up_kernels`), every model's linears and experts packed for them, its attention layers' backends
        made anew (they look the kernels up when made), the recurrent layers' kernels looked up, and the
        forward compiled (with --compile-in-background, in the compile process)."""
        self.kernels_pending = False
        started = time.monotonic()
        models = [model for model in (self.model, self.draft_model) if model is not None]
        for model in models:
            quant_methods = {getattr(module, "quant_method", None) for module in model.modules()} - {None}
            for quant in quant_methods:
                quant.take_up_kernels(model)
            for layer in model.modules():
                if isinstance(layer, FusedMoE):
                    layer.take_up_kernels()
            self._pack_linears(model)
            self._pack_experts(model)
            for layer in model.attention_layers():
                layer.impl = type(layer.impl)(layer.impl.spec)
        self.recurrent_kernels = self.setup.platform.recurrent_kernels()
        self.model_bytes = sum(model_weight_bytes(model) for model in models)
        self.compiler.take_the_core_back()
        self.forward = self._compile()
        logger.info(
            "kernels taken up between two steps in %.2fs (weights now %.2f GiB)",
            time.monotonic() - started,
            self.model_bytes / GiB,
        )

    def _check_state_layers(self) -> int:
        """The most sequences at once: --max-num-seqs, which a model with recurrent layers also takes as its
        number of state slots (logged with their size). Refuses what those models cannot do yet."""
        config = self.setup.config
        if not self.state_layers:
            return config.max_num_seqs
        if config.speculative is not None:
            raise ConfigError(
                "speculative decoding is not supported for models with recurrent layers (a rejected draft "
                "would need the state before it); drop --speculative-config"
            )
        return config.max_num_seqs

    def _state_slots(self, budget: int) -> int:
        """State slots for a KV-cache budget: --max-num-seqs, lowered until the states take at most half of
        the budget (the rest holds KV blocks). Logged with the states' size."""
        per_sequence = sum(layer.state_spec().bytes for layer in self.state_layers)
        slots = max(1, min(self.max_num_seqs, budget // 2 // per_sequence))
        logger.info(
            "recurrent state: %d layers, %.2f MiB per sequence, %d slots (%s): %.2f GiB",
            len(self.state_layers),
            per_sequence / 2**20,
            slots,
            "--max-num-seqs" if slots == self.max_num_seqs else "at most half the KV cache budget",
            per_sequence * slots / GiB,
        )
        return slots

    def state_bytes(self) -> int:
        """Bytes of every recurrent layer's state slots on this rank (0 for a model without)."""
        return sum(layer.state_spec().bytes for layer in self.state_layers) * self.max_num_seqs

    def block_bytes(self) -> int:
        """Bytes of one KV block over this rank's KV tensors (one per layer with one KV cache group, one per
        layer of a group with several), the draft model's included."""
        tensors = num_kv_tensors(self.layers, self.kv_layout)
        total = kv_block_bytes(self.setup, self.parallel.tp, self.block_size, tensors)
        if self.draft_model is not None:
            layers = len(self.draft_model.attention_layers())
            total += kv_block_bytes(self.draft_setup, self.parallel.tp, self.block_size, layers)
        return total

    def kv_windows(self) -> tuple[int | None, ...]:
        """Each KV cache group's sliding window as the KV cache manager is to honour it (None: the group
        keeps every block): a KV connector moves whole block tables, and a draft model reads group 0's."""
        windows = list(self.kv_layout.windows)
        if self.setup.config.kv_transfer is not None:
            windows = [None] * len(windows)
        elif self.draft_model is not None:
            windows[0] = None
        return tuple(windows)

    def _num_blocks(self) -> int:
        """KV blocks in this rank's memory budget: --num-kv-blocks, else what the platform leaves after the
        profiled step's peak (or the memory in use, on a platform without a peak counter)."""
        config = self.setup.config
        if config.num_kv_blocks is not None:
            if self.state_layers:
                self._state_slots(2 * self.state_bytes())  # as many as --max-num-seqs: logged
            return config.num_kv_blocks
        platform = self.setup.platform
        index = self.device.index or 0
        peak = self._profile_memory(index)
        if peak is None:
            peak = platform.memory_in_use(self.model_bytes, index)
        budget = platform.kv_cache_bytes(config, self.model_bytes, peak)
        if self.state_layers:  # the states' slots come out of the same budget
            self.max_num_seqs = self._state_slots(budget)
            budget -= self.state_bytes()
        per_request = blocks_per_request(
            self.kv_windows(),
            self.block_size,
            self.setup.max_model_len + self.block_size,
            config.step_tokens(self.setup.max_model_len),
        )
        num_blocks = blocks_in_budget(self.setup, budget, self.block_bytes(), self.model_bytes, per_request)
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
        num_tokens = config.step_tokens(self.setup.max_model_len)  # the scheduler's largest step
        shape = kv_cache_shape(self.setup, self.parallel.tp, 1, self.block_size)
        dtype = rank_spec(self.setup, self.parallel.tp).cache_dtype
        cache = torch.zeros(shape, dtype=dtype, device=self.device)  # block 0, read, never written
        if self.parallel.world_size > 1:
            # ranks load at their own pace, and the step's collectives time out sooner than start-up's
            torch.distributed.barrier(group=self.parallel.startup)
        platform.synchronize()
        platform.reset_peak_memory(index)
        before = platform.peak_memory_allocated(index)
        attn = dummy_prefill(num_tokens, self.block_size, self.device)
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

    def _make_spec_decode(self) -> RunnerSpecDecode:
        """The proposer (a draft model gets KV tensors of its own, addressed by the target's block tables)
        and the verification of its drafts."""
        draft = None
        if self.draft_model is not None:
            layers = self.draft_model.attention_layers()
            caches = allocate_kv_caches(
                self.draft_setup, self.parallel.tp, layers, self.num_blocks, self.block_size, self.device
            )
            draft = (self.draft_setup, self.draft_model, caches)
        speculative = self.setup.config.speculative
        proposer = make_proposer(
            speculative, draft, self.block_size, self.input_batch.block_table, self.device
        )
        return RunnerSpecDecode(
            speculative,
            proposer,
            self.setup.max_model_len,
            self.sampler,
            self.generators,
            self.eos_token_ids,
            self.compute_logits,
            self.device,
        )

    def _capture_graphs(self) -> DecodeGraphs | None:
        """Decode steps' CUDA graphs, captured now that the KV cache exists, where they apply."""
        allowed = decode_graphs_allowed(
            self.setup,
            lora=self.lora is not None,
            split=self.parallel.world_size > 1,
            speculative=self.spec_decode is not None,
        )
        # a replayed step has no state slots or three-axis positions to hand over
        if not allowed or self.state_layers or self.uses_mrope:
            return None
        config = self.setup.config
        return capture_decode_graphs(
            self.forward,
            self.setup.backend,
            self.kv_caches,
            self.layers,
            config.max_num_seqs,
            self.setup.max_model_len,
            self.block_size,
            self.device,
            self.layer_groups,
        )

    @property
    def kv_connector(self) -> KVConnector | None:
        """The KV connector's worker half (with --kv-transfer-config), over this runner's KV caches."""
        return self.kv_transfer.connector if self.kv_transfer is not None else None

    @property
    def kv_context(self) -> KVConnectorContext | None:
        """What the connector's scheduler half must share with its worker half (block size, namespace)."""
        return self.kv_transfer.context if self.kv_transfer is not None else None

    # -- per-request state ----------------------------------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> None:
        """Load an adapter into memory (ConfigError when LoRA is off or the adapter cannot run)."""
        if self.lora is None:
            raise ConfigError("a request names a LoRA adapter, but LoRA is off; start with enable_lora=True")
        self.lora.add(request)

    def _update_states(self, out: SchedulerOutput) -> None:
        """Bring the per-request state up to date with the step's `SchedulerOutput`, the one way the runner
        hears of requests (vLLM v1's `_update_states`), so its state cannot drift from the scheduler's.
        Finished and aborted requests lose everything; preempted ones their batch row, a pooling request's
        partial pool (it pools its prompt again) and image outputs, but keep their seeded generator for when
        they resume. A request scheduled for the first time gets its generator; a resumed one (also in
        `new_request_ids`) has it already, as has one rerun alone after a failed step. A batch row comes
        with a request's first `_prepare_inputs`."""
        gone = [*out.finished_ids, *out.preempted]
        for request_id in gone:
            self.input_batch.remove(request_id)
            self.pooling_states.pop(request_id, None)
        for request_id in out.finished_ids:
            self.generators.pop(request_id, None)
        if self.encoder_cache is not None and gone:
            self.encoder_cache.release(gone)
        for request in out.scheduled:
            request_id, params = request.request_id, request.sampling_params
            if request_id in out.new_request_ids and params is not None and request_id not in self.generators:
                self.generators[request_id] = make_generator(params, self.device)

    # -- a step -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one scheduled step: take in what it says of requests (`_update_states`), prepare its inputs,
        run the model, then pool, compute prompt logprobs and sample (or verify drafts and propose the next
        ones)."""
        if self.kernels_pending and self.setup.platform.kernels_built():
            self._take_up_kernels()
        if self.compiler.pending:
            self.forward = self.compiler.swapped(self.forward)
        self._update_states(out)
        if self.kv_transfer is not None:
            self.kv_transfer.start_loads(out)
        if out.is_empty:  # only transfers to run, or requests to forget
            return StepResult(kv_connector_output=self._kv_transfers_done(out))
        step = self._prepare_inputs(out)
        hidden = self._run_model(step)
        result = StepResult(kv_connector_output=self._kv_transfers_done(out))
        if step.pooling:
            self._pool(hidden, step, result)
        if step.prompt_logprobs:
            self._prompt_logprobs(hidden, step, result)
        if not step.sampling:
            return result
        if out.spec_token_ids:
            self.spec_decode.verify(out, hidden, step.sampling, step.cu, result)
        else:
            self._sample(out, hidden, step, result)
        if self.spec_decode is not None:
            self.spec_decode.propose(step.sampling, self.input_batch.rows, result)
        return result

    def _prepare_inputs(self, out: SchedulerOutput) -> PreparedStep:
        """Bring the scheduled requests' rows of the persistent batch up to date (new tokens and blocks, and
        the drafts to verify after the known tokens), gather the step's flat model inputs from them, and
        note which requests sample, pool or want prompt logprobs this step."""
        batch = self.input_batch
        rows, counts, starts = [], [], []
        sampling, prompt_lp, pooling = [], [], []  # (index in batch, request)
        for i, request in enumerate(out.scheduled):
            rid = request.request_id
            row = batch.row(rid)
            batch.sync(row, request.all_token_ids, out.block_tables(rid))
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
        arrays, cu = batch.step_arrays(rows, starts, counts)
        if self.state_layers:
            arrays.state_slots = np.asarray(rows, dtype=np.int64)
        if self.uses_mrope:
            arrays.mrope_positions = mrope_positions(out.scheduled, arrays.positions, cu)
        if self.rope_length_base is not None:  # the length transformers rotates each token for
            prompt = self.rope_length_base == "prompt"
            base = [r.num_prompt_tokens if prompt else r.num_tokens for r in out.scheduled]
            arrays.rope_lengths = np.maximum(np.repeat(base, counts), arrays.positions + 1)
        if self.bidirectional_images:
            arrays.bidirectional = image_spans(out.scheduled, starts, counts)
        lora = self.lora.batch(out.scheduled, cu) if self.lora is not None else None
        images = self.encoder_cache.step_images(out.scheduled, starts, cu) if self.encoder_cache else None
        return PreparedStep(arrays, cu, starts, sampling, prompt_lp, pooling, lora, images)

    def _run_model(self, step: PreparedStep) -> torch.Tensor:
        """The final hidden states of the step's rows. The other ranks get the same inputs and run the same
        forward; a decode-only step replays a CUDA graph where one holds it, any other runs eagerly (and the
        proposer sees it)."""
        if self.parallel.world_size > 1:
            self.parallel.broadcast(("forward", step.arrays))
        hidden = self.graphs.run(step.arrays) if self.graphs is not None else None
        if hidden is None:
            inputs = self._forward(step.arrays, step.lora, step.images)
            hidden = inputs.hidden
            if self.spec_decode is not None:
                self.spec_decode.observe(inputs)
        return hidden

    def _forward(
        self, step: StepArrays, lora: LoRABatch | None = None, images: ImageBatch | None = None
    ) -> StepInputs:
        """Run the model on one step's arrays (on the device: input ids, positions, the attention batch of
        each KV cache group) under the backend's metadata, each layer its group's; returns them (group 0's
        attention batch, which a draft model reads) with the final hidden states."""
        query_start_loc, seq_lens = self._dev(step.query_start_loc), self._dev(step.seq_lens)
        max_query_len, max_seq_len = int(np.diff(step.query_start_loc).max()), int(step.seq_lens.max())
        spans = () if step.bidirectional is None else tuple(map(tuple, step.bidirectional.tolist()))
        attns = [
            AttentionBatch(
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                block_tables=self._dev(block_tables),
                slot_mapping=self._dev(slot_mapping),
                query_start_loc_cpu=torch.from_numpy(step.query_start_loc),
                seq_lens_cpu=torch.from_numpy(step.seq_lens),
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                bidirectional=spans,
            )
            for block_tables, slot_mapping in step.kv_groups()
        ]
        metadata = [self.setup.backend.build_metadata(attn) for attn in attns]
        layer_metadata = None
        if self.layer_groups is not None:
            layer_metadata = [metadata[g] for g in self.layer_groups]
        input_ids, positions = self._dev(step.input_ids), self._dev(step.positions)
        if step.mrope_positions is not None:
            positions = self._dev(step.mrope_positions)
        lengths = self._dev(step.rope_lengths) if step.rope_lengths is not None else None
        state = None
        if step.state_slots is not None:
            qsl = step.query_start_loc.tolist()
            state = StateBatch(
                slots=self._dev(step.state_slots),
                slot_list=step.state_slots.tolist(),
                query_start_loc=qsl,
                fresh=[int(n) == b - a for n, a, b in zip(step.seq_lens, qsl, qsl[1:], strict=False)],
                caches=self.state_caches,
                kernels=self.recurrent_kernels,
            )
        with set_forward_context(
            metadata[0],
            self.kv_caches,
            self.layers,
            lora,
            rope_lengths=lengths,
            layer_metadata=layer_metadata,
            state=state,
            images=images,
        ):
            hidden = self.forward(input_ids, positions)
        return StepInputs(input_ids, positions, attns[0], hidden)

    def _kv_transfers_done(self, out: SchedulerOutput) -> KVConnectorOutput | None:
        """After the forward: the KV connector's saves done and the transfers it reports finished."""
        return self.kv_transfer.finish_step(out) if self.kv_transfer is not None else None

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

    # -- a step's outputs ---------------------------------------------------------------------------------

    def _sample(
        self, out: SchedulerOutput, hidden: torch.Tensor, step: PreparedStep, result: StepResult
    ) -> None:
        """One token for each sampling request, from the logits of its last row (and its logprobs)."""
        sampling, cu = step.sampling, step.cu
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
            lp = LogprobLists.read(sampled.logprobs)
            for j, (_, request) in enumerate(sampling):
                k = request.sampling_params.logprobs
                if k is not None:
                    result.logprobs[request.request_id] = [row_logprobs(lp, j, k, token_ids[j])]

    def _pool(self, hidden: torch.Tensor, step: PreparedStep, result: StepResult) -> None:
        """Feed each pooling request's rows to its `PoolingState`; a prompt that ends in this step gets its
        pooled float32 vector (on the CPU) in `result.pooled`."""
        cu, starts = step.cu, step.starts
        for i, request in step.pooling:
            rid = request.request_id
            state = self.pooling_states.setdefault(rid, PoolingState())
            rows = hidden[int(cu[i]) : int(cu[i + 1])]
            vector = state.add(request.pooling_params.pooling_type, rows, starts[i], request.num_tokens)
            if vector is not None:
                result.pooled[rid] = vector.cpu()
                del self.pooling_states[rid]

    def _prompt_logprobs(self, hidden: torch.Tensor, step: PreparedStep, result: StepResult) -> None:
        """Logprobs of the prompt tokens this step's rows predict (position p predicts token p + 1), for
        all the requests that asked at once: one logits computation and one read to the host."""
        prompt_lp, cu, starts = step.prompt_logprobs, step.cu, step.starts
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
            lp = LogprobLists.read(tensors)
        row = 0
        for (i, request), count in zip(prompt_lp, counts, strict=True):
            k = request.sampling_params.prompt_logprobs
            entries: list = [None] if starts[i] == 0 else []
            entries += [row_logprobs(lp, row + j, k, targets[row + j]) for j in range(count)]
            row += count
            result.prompt_logprobs[request.request_id] = entries

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        return host_to_device(array, self.device)


def check_batch_invariant(model: torch.nn.Module) -> None:
    """Refuse, at start-up, a model with layers that have no batch-invariant kernels: experts (grouped by
    the tokens that chose them), recurrent layers (chunked prefill algorithms), an unpacked linear or
    output projection (F.linear's GEMM picks its blocking by the number of rows)."""
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            kind = "mixture-of-experts layers"
        elif isinstance(module, RecurrentLayer):
            kind = "recurrent layers"
        elif isinstance(module, Linear) and module.packed_matmul is None and module.weight is not None:
            kind = "linear layers the platform does not pack"
        else:
            continue
        raise ConfigError(
            f"--batch-invariant: {type(model).__name__} has {kind} ({name}), which have no "
            "batch-invariant kernels yet; run without --batch-invariant"
        )
    if getattr(model, "lm_head", None) is not None and getattr(model, "packed_lm_head", None) is None:
        raise ConfigError(
            f"--batch-invariant: {type(model).__name__}'s output projection has no batch-invariant kernel; "
            "run without --batch-invariant"
        )


def _by_layer_idx(layers: list) -> list:
    """Attention layers at their layer_idx, None where another pipeline stage holds the layer."""
    table = [None] * (max((layer.layer_idx for layer in layers), default=-1) + 1)
    for layer in layers:
        table[layer.layer_idx] = layer
    return table
