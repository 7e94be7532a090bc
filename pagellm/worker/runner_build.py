"""What the model runner steps on, made at start-up (`RunnerBuild`): the model, its caches and their sizes,
the forward.

In order: this rank's device bound; the model (and a draft model) loaded, its weights counted and packed
for the platform's kernels; the KV cache sized (a profiled dummy step where the platform counts its peak,
the recurrent layers' state slots out of the same budget) and allocated; the forward compiled; the state
slots allocated. Two parts wait for the runner's own (`ModelRunner.__init__`): the speculative decoding
part, which reads its persistent batch, sampler and seeded generators, and the decode steps' CUDA graphs,
captured last, over the finished caches. Kernels that were still building at start-up are taken up here
too, between two steps (`take_up_kernels`): it packs and compiles again.

It is apart from `model_runner.py` so that the per-step code reads on its own, and start-up's order is in
one place. The runner holds the build and reads its parts under the names the engine, the benchmarks and
the tests use (`runner.model`, `runner.kv_caches`, `runner.num_blocks`...), writing through to it when it
swaps in a compiled forward, so there is one copy of each.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from pagellm.core.errors import ConfigError
from pagellm.core.kv_cache_spec import LocalChunk, blocks_per_request
from pagellm.core.native_decode import NativeDecodeStep, NativeHeadStep
from pagellm.core.platform import GiB
from pagellm.distributed import Parallel
from pagellm.models.base import ModelInit
from pagellm.models.context import set_forward_context
from pagellm.models.layers import sparse_attention
from pagellm.models.layers.fused_moe.layer import FusedMoE, place_mxfp4_experts
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.recurrent import RecurrentLayer
from pagellm.models.layers.rotary import request_length_base
from pagellm.models.loader import load_model, model_weight_bytes
from pagellm.sampling.params import MAX_LOGPROBS, SamplingParams
from pagellm.sampling.sampler import Sampler, SamplingRequest, build_sampling_batch
from pagellm.spec_decode.eagle import load_eagle3
from pagellm.spec_decode.eagle_head import Eagle3Head
from pagellm.spec_decode.head_proposer import ChainedHeadProposer
from pagellm.spec_decode.mtp import load_mtp
from pagellm.worker.cuda_graphs import DecodeGraphs, capture_decode_graphs, decode_graphs_allowed
from pagellm.worker.encoder_cache import EncoderCache
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.kv_cache import (
    allocate_kv_caches,
    blocks_in_budget,
    kv_block_bytes,
    kv_cache_shape,
    kv_layout,
    layers_block_bytes,
    rank_spec,
)
from pagellm.worker.runner_compile import CoreYield, RunnerCompile, dummy_prefill
from pagellm.worker.runner_lora import RunnerLoRA
from pagellm.worker.runner_spec_decode import RunnerSpecDecode, make_proposer
from pagellm.worker.state_cache import allocate_states
from pagellm.worker.step import EngineSetup

logger = logging.getLogger("pagellm")


class RunnerBuild:
    def __init__(
        self,
        setup: EngineSetup,
        weights: Iterable[tuple[str, torch.Tensor]],
        draft: tuple[EngineSetup, Iterable[tuple[str, torch.Tensor]]] | None,
        parallel: Parallel | None,
        eos_token_ids: set[int],
    ):
        """As `ModelRunner`'s arguments (`eos_token_ids`: the memory profile's sampler and the speculative
        decoding part stop on them)."""
        config = setup.config
        self.setup = setup
        self.parallel = parallel or Parallel()
        self.device = self._bind_device()
        self.block_size = config.block_size
        self.eos_token_ids = eos_token_ids
        self.model_bytes = 0  # both models' weights as loaded (before the platform packs them; again in
        # `take_up_kernels`)
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
        self.draft_head = self._load_draft_head() if config.speculative else None
        # KV slots a proposer writes past a step's tokens: a draft model's own k - 1 steps ahead, and one more
        own_kv = self.draft_model is not None or self._head_keeps_kv()
        self.num_lookahead_tokens = config.speculative.num_speculative_tokens if own_kv else 0
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
        self.kernels_pending = setup.kernels_pending  # until `take_up_kernels`
        self.compiler = self._make_compiler()
        self.forward = self.compile()  # what the steps run
        # a recurrent layer's state slot is its request's row of the runner's batch (core/state.py)
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
        sparse_attention.use_kernels(setup.platform.sparse_attention_kernels())
        if self.state_layers:
            logger.info("recurrent layers' kernels: %s", self.recurrent_kernels.describe())

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
        if not setup.kernels_pending:  # else packed when the kernels are built (`take_up_kernels`)
            self.pack_linears(model)
            self.pack_experts(model)
        if setup.config.batch_invariant:
            check_batch_invariant(model)
        return model

    def _load_draft_head(self):
        """A draft head reading the target's hidden states, on this device: an EAGLE-3 head
        (`spec_decode/eagle_head.py`) or the checkpoint's MTP layer (`spec_decode/mtp.py`); None for the
        other methods. A split target is refused at start-up (`engine/setup.py`: the head reads hidden
        states the ranks would each hold part of)."""
        method = self.setup.config.speculative.method
        if method not in ("eagle3", "mtp"):
            return None
        init = ModelInit(self.setup.hf_config, self.setup.dtype, self.setup.backend, self.block_size,
                         kv_cache_dtype=self.setup.spec.kv_cache_dtype)  # fmt: skip
        if method == "mtp":
            head = load_mtp(self.setup, self.model, init, self.device)
        else:
            head = load_eagle3(self.setup.config.speculative.model, self.model, init).to(self.device)
        self.model_bytes += model_weight_bytes(head)
        if not self.setup.kernels_pending:  # else packed when the kernels are built (`take_up_kernels`)
            self.pack_linears(head)
            self.pack_experts(head)
        speculative = self.setup.config.speculative
        what = (
            f"EAGLE-3 head {speculative.model}"
            if method == "eagle3"
            else f"Gemma 4 assistant {speculative.model}"
            if speculative.model
            else "the checkpoint's MTP layer"
        )
        logger.info("speculative decoding: %s, %d tokens a step", what, speculative.num_speculative_tokens)
        return head

    def _head_keeps_kv(self) -> bool:
        """Whether the draft head keeps a KV cache of its own (a Gemma 4 assistant reads the target's)."""
        return self.draft_head is not None and not getattr(self.draft_head, "reads_target_kv", False)

    def pack_linears(self, model) -> None:
        """Let the platform prepack every plain linear layer's weight (`Platform.pack_linear`), and the
        output projection's for `CausalLM.project_logits`. A tied lm_head is the embedding, which needs its
        plain weight too, so it gets a packed copy (memory: the vocab x hidden weight once more). A draft
        head (no `packed_lm_head`: an EAGLE-3 head, an MTP layer) packs its lm_head as any linear. A module
        with per-head products (`pack_per_head`: MLA's up-projections) hands them to
        `Platform.pack_per_head`."""
        lm_head = getattr(model, "lm_head", None) if hasattr(model, "packed_lm_head") else None
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
            elif (
                callable(getattr(module, "pack_per_head", None))
                and module.weight is not None
                and not self.setup.config.batch_invariant  # the per-head kernel's sums follow the rows
            ):
                module.pack_per_head(self.setup.platform.pack_per_head)
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

    def pack_experts(self, model) -> None:
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

    def _make_compiler(self) -> RunnerCompile:
        """The compiled forward's maker (`RunnerCompile`), over the KV cache just allocated."""
        return RunnerCompile(
            self.model,
            self.setup,
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
                self.kv_windows(), self.block_size, self.setup.max_model_len + self.block_size, 1
            ),
            cores=self.cores,
        )

    def compile(self) -> Callable[..., torch.Tensor]:
        """The compiled forward (`RunnerCompile`); the eager model with --enforce-eager, LoRA (the LoRA
        terms' row groups change every step), a split model (collectives stay out of compiled graphs), an
        EAGLE-3 head (it reads hidden states through layer hooks, which a compiled graph does not call), an
        attention backend a compiled graph cannot call (`AttentionBackend.not_in_compiled_graphs`, logged),
        and while the platform's kernels build (the graph calls them: compiled after `take_up_kernels`)."""
        config = self.setup.config
        if (
            config.enforce_eager
            or self.lora is not None
            or self.parallel.world_size > 1
            or self._hooks_layers()
        ):
            return self.model
        backend = self.setup.backend
        if backend.not_in_compiled_graphs is not None:
            logger.info("compiled forward: off (%s: %s)", backend.name, backend.not_in_compiled_graphs)
            return self.model
        if self.kernels_pending:
            self.compiler.yield_a_core()  # the build's, as a compile process's
            return self.model
        return self.compiler.forward()

    def _hooks_layers(self) -> bool:
        """Whether the proposer reads hidden states through hooks on the target's layers (EAGLE-3)."""
        speculative = self.setup.config.speculative
        return speculative is not None and speculative.method == "eagle3"

    def take_up_kernels(self) -> None:
        """Between two steps (`ModelRunner.execute`), once the kernels building in the background are built
        (or failed: then what is done here changes nothing): what a quantization method loaded another way
        meanwhile put back on them (`QuantMethod.take_up_kernels`: a GGUF file's widened blocks, its experts: `FusedMoE.
        take_up_kernels`), every model's linears and experts packed for them, its attention layers' backends
        made anew (they look the kernels up when made), the recurrent layers' kernels looked up, and the
        forward compiled (with --compile-in-background, in the compile process)."""
        self.kernels_pending = False
        started = time.monotonic()
        models = [model for model in (self.model, self.draft_model, self.draft_head) if model is not None]
        for model in models:
            quant_methods = {getattr(module, "quant_method", None) for module in model.modules()} - {None}
            for quant in quant_methods:
                quant.take_up_kernels(model)
            for layer in model.modules():
                if isinstance(layer, FusedMoE):
                    layer.take_up_kernels()
            self.pack_linears(model)
            self.pack_experts(model)
            for layer in model.attention_layers():
                layer.impl = type(layer.impl)(layer.impl.spec)
        self.recurrent_kernels = self.setup.platform.recurrent_kernels()
        sparse_attention.use_kernels(self.setup.platform.sparse_attention_kernels())
        self.model_bytes = sum(model_weight_bytes(model) for model in models)
        self.compiler.take_the_core_back()
        self.forward = self.compile()
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
            others = sorted({type(layer).__name__ for layer in self.state_layers if not layer.replays_drafts})
            if others:
                raise ConfigError(
                    f"speculative decoding is not supported for models with these recurrent layers: "
                    f"{', '.join(others)} (a rejected draft needs the state before it, which only the "
                    "delta-rule layers keep); drop --speculative-config"
                )
            if self.parallel.world_size > 1:
                raise ConfigError(
                    "speculative decoding of a model with recurrent layers runs on one rank (the states of "
                    "the accepted drafts are kept after the verification, which only the driver runs)"
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
        total = layers_block_bytes(self.setup, self.parallel.tp, self.block_size, self.layers, self.kv_layout)
        if self.draft_model is not None:
            layers = len(self.draft_model.attention_layers())
            total += kv_block_bytes(self.draft_setup, self.parallel.tp, self.block_size, layers)
        if self.draft_head is not None:
            head_layers = self.draft_head.attention_layers()
            total += layers_block_bytes(self.setup, self.parallel.tp, self.block_size, head_layers, None)
        return total

    def kv_windows(self) -> tuple[int | None, ...]:
        """Each KV cache group's sliding window as the KV cache manager is to honour it (None: the group
        keeps every block): a KV connector moves whole block tables, a draft model reads group 0's, and a
        Gemma 4 assistant reads one token further back than the target's next query."""
        windows = list(self.kv_layout.windows)
        if self.setup.config.kv_transfer is not None:
            windows = [None] * len(windows)
        elif self.draft_model is not None or self._head_keeps_kv():
            windows[0] = None
        elif self.draft_head is not None:
            windows = [w if w is None or isinstance(w, LocalChunk) else w + 1 for w in windows]
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
        dtype = rank_spec(self.setup, self.parallel.tp).cache_dtype
        caches = [  # block 0 of each layer's shape, read, never written
            torch.zeros(
                kv_cache_shape(self.setup, self.parallel.tp, 1, self.block_size, layer),
                dtype=dtype,
                device=self.device,
            )
            for layer in self.layers
        ]
        if self.parallel.world_size > 1:
            # ranks load at their own pace, and the step's collectives time out sooner than start-up's
            torch.distributed.barrier(group=self.parallel.startup)
        platform.synchronize()
        platform.reset_peak_memory(index)
        before = platform.peak_memory_allocated(index)
        attn = dummy_prefill(num_tokens, self.block_size, self.device)
        with set_forward_context(self.setup.backend.build_metadata(attn), caches, self.layers):
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

    def spec_decode(
        self,
        block_table: np.ndarray,
        sampler: Sampler,
        generators: dict[str, torch.Generator | None],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        input_batch: InputBatch | None = None,
    ) -> RunnerSpecDecode | None:
        """The proposer (a draft model gets KV tensors of its own, addressed by the target's block tables:
        `block_table`, the runner's persistent batch's) and the verification of its drafts, with the
        runner's sampler, seeded generators and `compute_logits` (an EAGLE-3 head also reads the rows' tokens
        of `input_batch`); None without --speculative-config."""
        if not self.setup.config.speculative:
            return None
        draft = None
        if self.draft_model is not None:
            layers = self.draft_model.attention_layers()
            caches = allocate_kv_caches(
                self.draft_setup, self.parallel.tp, layers, self.num_blocks, self.block_size, self.device
            )
            draft = (self.draft_setup, self.draft_model, caches)
        if self._head_keeps_kv():
            layers = self.draft_head.attention_layers()
            caches = allocate_kv_caches(
                self.setup, self.parallel.tp, layers, self.num_blocks, self.block_size, self.device
            )
            draft = (self.setup, self.draft_head, caches, self.model, input_batch)  # eagle3 and mtp
        elif self.draft_head is not None:  # a Gemma 4 assistant: the target's caches, by KV cache group
            caches = (self.kv_caches, self.kv_layout.group_of if self.layer_groups else lambda _: 0)
            draft = (self.setup, self.draft_head, caches, self.model, input_batch)
        speculative = self.setup.config.speculative
        proposer = make_proposer(speculative, draft, self.block_size, block_table, self.device)
        return RunnerSpecDecode(
            speculative,
            proposer,
            self.setup.max_model_len,
            sampler,
            generators,
            self.eos_token_ids,
            compute_logits,
            self.device,
        )

    def capture_graphs(self, speculative: bool) -> DecodeGraphs | None:
        """Decode steps' CUDA graphs, captured now that the KV cache exists, where they apply (`speculative`:
        the runner has a speculative decoding part)."""
        allowed = decode_graphs_allowed(
            self.setup,
            lora=self.lora is not None,
            split=self.parallel.world_size > 1,
            speculative=speculative,
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

    def native_decode_step(
        self, *, aux_layers: tuple[int, ...], kv_transfer: bool
    ) -> NativeDecodeStep | None:
        """The platform's native decode step (`Platform.native_decode_step`), where the model and this
        engine's features allow it (`kv_transfer`: the runner has that part, which saves every step's
        layers), reporting the residual stream entering `aux_layers` (what a proposer reads); start-up logs
        whether it applies, and why."""
        step, why = None, ""
        config = self.setup.config
        if not config.native_decode:
            why = "--no-native-decode"
        elif self.lora is not None or kv_transfer or config.runner != "generate":
            why = "LoRA, KV transfer or a pooling runner reads or changes every layer"
        elif self.parallel.world_size > 1:
            why = "the model is split across ranks"
        elif self.layer_groups is not None:
            why = "its layers keep KV caches of several kinds (sliding windows)"
        elif self.state_layers or self.uses_mrope:
            why = "the model has recurrent layers or a multimodal rotary embedding"
        else:
            model = self.model.dense_decoder()
            if isinstance(model, str):
                why = model
            else:
                step, why = self.setup.platform.native_decode_step(
                    model, self.kv_caches, self.layers, self.block_size
                )
                if step is not None:
                    step.aux_layers = aux_layers
        logger.info("native decode step: %s (%s)", "on" if step is not None else "off", why)
        return step

    def native_head_step(self, proposer: ChainedHeadProposer) -> NativeHeadStep | None:
        """The platform's native pass of an EAGLE-3 head (`Platform.native_head_step`) over its KV cache,
        where the head allows it; start-up logs whether it applies, and why."""
        if not isinstance(proposer.head, Eagle3Head):
            return None
        head = proposer.head.draft_head()  # (tensor and pipeline parallelism refuse a head at start-up)
        step, why = None, "--no-native-decode" if not self.setup.config.native_decode else head
        if not isinstance(why, str):
            cache, attention = proposer.kv_caches[0], proposer.layers[0]
            step, why = self.setup.platform.native_head_step(head, cache, attention, self.block_size)
        logger.info("native draft head pass: %s (%s)", "on" if step is not None else "off", why)
        return step

    def log_kv_windows(self) -> None:
        """Say where the KV cache keeps blocks a sliding window would drop (`kv_windows`)."""
        if self.kv_windows() != self.kv_layout.windows:
            logger.info(
                "KV cache: sliding-window layers keep every block (%s)",
                "a KV connector moves whole block tables"
                if self.setup.config.kv_transfer is not None
                else "the draft model reads group 0's block table",
            )


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
