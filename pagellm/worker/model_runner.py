"""The model runner: runs one scheduled step on what `runner_build.py` made at start-up (the model, its KV
and state caches, the forward).

It hears of requests only from each step's `SchedulerOutput` (`_update_states`, first in `execute`). Then a
step is three jobs, one method each: `_prepare_inputs` brings the persistent `InputBatch` up to date and
gathers the flat `StepArrays` (token ids, positions, slot mapping, block tables, query offsets) and which
rows sample, pool or want prompt logprobs (`PreparedStep`); `_run_model` runs the forward on them (every
rank; a replayed CUDA graph where one fits); then the outputs: pooled vectors (`pooler.pool_step`), prompt
logprobs (`logprobs.prompt_logprobs`), and logits of only the rows that sample, sampled on the device.
Between two steps it may swap in a compiled forward or have the kernels that were building in the
background taken up (`RunnerBuild.take_up_kernels`).

The optional parts are helpers the runner holds, each None when off: `lora` (`runner_lora.py`),
`kv_transfer` (`runner_kv_connector.py`), `spec_decode` (`runner_spec_decode.py`) and `graphs`
(`cuda_graphs.py`). The KV cache's layout and size are `kv_cache.py`'s; with several KV cache groups
(`core/kv_cache_spec.py`: layers with different sliding windows) each group has its own block tables,
slot mapping and attention metadata, and each layer runs with its group's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import torch

from pagellm.core.errors import ConfigError
from pagellm.core.kv_connector import KVConnector, KVConnectorContext, KVConnectorOutput
from pagellm.core.native_decode import NativeDecodeStep
from pagellm.distributed import Parallel
from pagellm.lora.request import LoRARequest
from pagellm.models.context import ImageBatch, LoRABatch, StateBatch, set_forward_context
from pagellm.sampling.sampler import Sampler, SamplingRequest, build_sampling_batch, make_generator
from pagellm.spec_decode.head_proposer import ChainedHeadProposer
from pagellm.spec_decode.proposer import StepInputs
from pagellm.worker.input_batch import (
    InputBatch,
    PreparedStep,
    attention_batches,
    host_to_device,
    image_spans,
    mrope_positions,
)
from pagellm.worker.logprobs import LogprobLists, prompt_logprobs, row_logprobs
from pagellm.worker.pooler import PoolingState, pool_step
from pagellm.worker.runner_build import RunnerBuild
from pagellm.worker.runner_kv_connector import RunnerKVConnector
from pagellm.worker.state_cache import state_batch
from pagellm.worker.step import EngineSetup, SchedulerOutput, StepArrays, StepResult

logger = logging.getLogger("pagellm")


def _built(name: str) -> property:
    """`RunnerBuild`'s attribute `name` as the runner's own, read and written through (one copy of each)."""
    return property(
        lambda runner: getattr(runner.built, name),
        lambda runner, value: setattr(runner.built, name, value),
    )


class ModelRunner:
    # what `RunnerBuild` made, under the names the engine, the benchmarks and the tests read; the last four
    # change between steps (a compiled forward swapped in, `RunnerBuild.take_up_kernels`)
    setup = _built("setup")
    parallel = _built("parallel")
    device = _built("device")
    block_size = _built("block_size")
    model = _built("model")
    layers = _built("layers")  # attention layers by layer_idx, None where another pipeline stage has one
    layer_groups = _built("layer_groups")
    kv_layout = _built("kv_layout")
    kv_windows = _built("kv_windows")
    block_bytes = _built("block_bytes")
    num_blocks = _built("num_blocks")
    kv_caches = _built("kv_caches")
    num_lookahead_tokens = _built("num_lookahead_tokens")
    state_layers = _built("state_layers")
    max_num_seqs = _built("max_num_seqs")
    state_caches = _built("state_caches")
    rope_length_base = _built("rope_length_base")
    uses_mrope = _built("uses_mrope")
    bidirectional_images = _built("bidirectional_images")
    encoder_cache = _built("encoder_cache")
    lora = _built("lora")
    compiler = _built("compiler")
    forward = _built("forward")
    kernels_pending = _built("kernels_pending")
    model_bytes = _built("model_bytes")
    recurrent_kernels = _built("recurrent_kernels")

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
        self.eos_token_ids = set(eos_token_ids)
        self.built = RunnerBuild(setup, weights, draft, parallel, self.eos_token_ids)
        self.input_batch = InputBatch(
            self.max_num_seqs, setup.max_model_len, self.block_size, self.kv_layout.num_groups
        )
        self.generators: dict[str, torch.Generator | None] = {}
        self.pooling_states: dict[str, PoolingState] = {}  # pooling requests mid-prompt
        self.sampler = Sampler(
            torch.Generator(device=self.device).manual_seed(config.seed), argmax=setup.platform.argmax
        )
        self.spec_decode = self.built.spec_decode(
            self.input_batch.block_table, self.sampler, self.generators, self.compute_logits, self.input_batch
        )
        self.kv_transfer = (
            RunnerKVConnector(setup, self.parallel.tp, self.kv_caches, self.block_size)
            if config.kv_transfer is not None
            else None
        )
        # decode steps replayed from CUDA graphs
        self.graphs = self.built.capture_graphs(speculative=self.spec_decode is not None)
        # a decode step in one native call, where the platform has it
        self.native_decode = self._native_decode_step()
        self.step_states: StateBatch | None = None  # the last forward's recurrent states (`_forward`)
        self.built.log_kv_windows()

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
            self.built.take_up_kernels()
            self.native_decode = self._native_decode_step()
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
            pool_step(self.pooling_states, hidden, step, result, self.model.compute_logits)
        if step.prompt_logprobs:
            prompt_logprobs(hidden, step, result, self.compute_logits, self.device)
        if not step.sampling:
            return result
        if out.spec_token_ids:
            self.spec_decode.verify(out, hidden, step.sampling, step.cu, result)
            self._keep_accepted_states(step, result)
        else:
            self._sample(out, hidden, step, result)
        if self.spec_decode is not None:
            self.spec_decode.propose(step.sampling, self.input_batch.rows, result)
        return result

    def _keep_accepted_states(self, step: PreparedStep, result: StepResult) -> None:
        """The recurrent layers' states of each request that verified drafts, as of the rows it keeps: its
        last known token and the accepted drafts (the step advanced them over every draft)."""
        if self.step_states is None or not self.step_states.replays:
            return
        request_ids = {i: r.request_id for i, r in step.sampling}
        for replay in self.step_states.replays:
            replay.keep(len(result.sampled[request_ids[replay.request]]))

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
            if out.spec_token_ids:
                known = np.array([r.num_tokens for r in out.scheduled], dtype=np.int64)
                arrays.state_drafts = np.maximum(np.add(starts, counts) - known, 0)
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
        if hidden is None and self.native_decode is not None:
            hidden = self._run_native_decode(step.arrays)
            if hidden is not None and self.spec_decode is not None:
                self.spec_decode.observe(self._native_step_inputs(step.arrays, hidden))
        if hidden is None:
            inputs = self._forward(step.arrays, step.lora, step.images)
            hidden = inputs.hidden
            if self.spec_decode is not None:
                self.spec_decode.observe(inputs)
        return hidden

    def _native_decode_step(self) -> NativeDecodeStep | None:
        """The target's native decode step, and a draft head's native pass where the proposer has one."""
        proposer = self.spec_decode.proposer if self.spec_decode is not None else None
        if isinstance(proposer, ChainedHeadProposer):
            proposer.native = self.built.native_head_step(proposer)
        aux_layers = proposer.aux_layers if proposer is not None else ()
        return self.built.native_decode_step(aux_layers=aux_layers, kv_transfer=self.kv_transfer is not None)

    def _run_native_decode(self, a: StepArrays) -> torch.Tensor | None:
        """The final hidden states of a step of decodes only: each request's new token at the end of its
        context, with the drafts to verify after it when speculating (rows of one request at consecutive
        positions, as many as a verify step takes), up to as many rows as the native step takes; None for
        any other step (it runs the forward)."""
        rows, requests = len(a.input_ids), len(a.seq_lens)
        if rows > self.native_decode.max_rows:
            return None
        if (
            a.more_groups
            or a.rope_lengths is not None
            or a.mrope_positions is not None
            or a.bidirectional is not None
        ):
            return None
        if rows == requests:
            if not np.array_equal(a.seq_lens, a.positions + 1):
                return None
            return self.native_decode(a.input_ids, a.positions, a.slot_mapping, a.block_tables)
        counts = np.diff(a.query_start_loc)
        if self.spec_decode is None or counts.max() > 1 + self.spec_decode.speculative.num_speculative_tokens:
            return None  # prefill chunks
        if not np.array_equal(np.repeat(a.seq_lens, counts), a.positions + 1 + _offsets_from_end(counts)):
            return None
        tables = np.repeat(a.block_tables, counts, axis=0)
        return self.native_decode(a.input_ids, a.positions, a.slot_mapping, tables)

    def _native_step_inputs(self, a: StepArrays, hidden: torch.Tensor) -> StepInputs:
        """What the proposer sees of a native step: as of the forward's, with the auxiliary hidden states the
        native step reported in place of its hooks'."""
        attn = attention_batches(a, self.device)[0]
        return StepInputs(
            self._dev(a.input_ids), self._dev(a.positions), attn, hidden, a.batch_rows, self.native_decode.aux
        )

    def _forward(
        self, step: StepArrays, lora: LoRABatch | None = None, images: ImageBatch | None = None
    ) -> StepInputs:
        """Run the model on one step's arrays (on the device: input ids, positions, the attention batch of
        each KV cache group) under the backend's metadata, each layer its group's; returns them (group 0's
        attention batch, which a draft model reads) with the final hidden states."""
        attns = attention_batches(step, self.device)
        metadata = [self.setup.backend.build_metadata(attn) for attn in attns]
        layer_metadata = None
        if self.layer_groups is not None:
            layer_metadata = [metadata[g] for g in self.layer_groups]
        input_ids, positions = self._dev(step.input_ids), self._dev(step.positions)
        if step.mrope_positions is not None:
            positions = self._dev(step.mrope_positions)
        lengths = self._dev(step.rope_lengths) if step.rope_lengths is not None else None
        state = state_batch(step, self.state_caches, self.recurrent_kernels, self.device)
        self.step_states = state  # its replays, for after a verification (`_keep_accepted_states`)
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
        return StepInputs(input_ids, positions, attns[0], hidden, step.batch_rows)

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

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        return host_to_device(array, self.device)


def _offsets_from_end(counts: np.ndarray) -> np.ndarray:
    """For rows grouped by request (`counts` rows each): how many rows of its request follow each row."""
    ends = np.repeat(np.cumsum(counts), counts)
    return ends - 1 - np.arange(int(counts.sum()))
