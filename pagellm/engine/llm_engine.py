"""`LLMEngine`: the synchronous engine loop that `LLM` and `AsyncLLM` drive.

add_request -> Processor (tokenize, validate, n child requests) -> scheduler -> each step(): schedule, run
the model, update the scheduler, then the OutputProcessor (detokenize, stop strings; pooled vectors) ->
RequestOutputs and PoolingRequestOutputs.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from pagellm.core.config import EngineConfig
from pagellm.core.dtypes import dtype_name
from pagellm.core.errors import ConfigError
from pagellm.core.kv_connector import KVConnector, KVConnectorRole
from pagellm.core.platform import GiB
from pagellm.core.pooling import PoolingParams
from pagellm.distributed import RankFailure
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.outputs import PoolingRequestOutput, RequestOutput
from pagellm.engine.processor import ProcessedPrompt, Processor, make_pooler
from pagellm.engine.request import Request, RequestStatus
from pagellm.engine.scheduler import Scheduler
from pagellm.engine.setup import resolve_engine
from pagellm.engine.tokenizer import load_tokenizer
from pagellm.lora.request import LoRARequest
from pagellm.sampling.params import SamplingParams
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.ranks import RankProcesses, Ranks
from pagellm.worker.ray_ranks import RayRanks
from pagellm.worker.runner_compile import CoreYield
from pagellm.worker.step import EngineSetup, SchedulerOutput, StepResult

logger = logging.getLogger("pagellm")

_TRANSFER_POLL_S = 0.002  # an empty step's pause while KV transfers are in flight
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        started = time.monotonic()
        self.config = config
        self.setup: EngineSetup = resolve_engine(config)
        for line in self.setup.explanation:
            logger.info(line)
        self.pooler = make_pooler(self.setup)  # None unless runner="pooling"
        _check_kv_transfer(self.setup)
        self.tokenizer, weights = load_tokenizer_and_weights(self.setup)
        self.eos_token_ids = _eos_token_ids(self.setup, self.tokenizer)
        self.default_params = _generation_defaults(self.setup) if config.generation_config == "auto" else {}
        self.ranks: Ranks | None = None
        self._failure: RankFailure | None = None
        parallel = None
        self._rank_release: _RankRelease | None = None
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            self.ranks = _start_ranks(self.setup)
            self._rank_release = _RankRelease(self.ranks)
            # an engine nobody references any more stops its ranks, so the next one may start its own
            weakref.finalize(self, self._rank_release)
            parallel = self.ranks.join()
        try:
            self.runner = ModelRunner(self.setup, weights, self.eos_token_ids, self._draft(), parallel)
            if self._rank_release is not None:
                self._rank_release.stop = self.runner.stop_ranks
            self.scheduler = self._scheduler(config)
        except Exception as exc:
            if self.ranks is not None:
                failure = self.ranks.failure(exc)
                self.shutdown()
                if failure is not None:
                    raise failure from exc
            raise
        self.max_model_len = self.setup.max_model_len
        self.processor = Processor(self.setup, self.tokenizer, self.eos_token_ids, self.pooler)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._serials = itertools.count()  # makes each request's engine id unique
        concurrency = self.scheduler.kv_cache_manager.max_concurrency(self.max_model_len)
        if self.runner.state_layers:  # one state slot per running request as well
            concurrency = min(concurrency, self.runner.max_num_seqs)
        logger.info(
            "pagellm ready in %.1fs: platform %s (%s), backend %s, dtype %s, weights %.2f GiB, KV cache %d blocks "
            "of %d tokens (%.2f GiB), max concurrency %.1f requests of %d tokens",
            time.monotonic() - started,
            self.setup.platform.name,
            self.setup.platform.device_name(),
            self.setup.backend.name,
            dtype_name(self.setup.dtype),
            self.runner.model_bytes / GiB,
            self.runner.num_blocks,
            config.block_size,
            self.runner.num_blocks * self.runner.block_bytes() / GiB,
            concurrency,
            self.max_model_len,
        )

    def _scheduler(self, config: EngineConfig) -> Scheduler:
        prefix_caching = config.enable_prefix_caching
        if prefix_caching and self.runner.state_layers:
            prefix_caching = False
            logger.info(
                "prefix caching off: a hit would need the recurrent layers' state at the end of the cached "
                "blocks, which is not kept"
            )
        return Scheduler(
            max_num_seqs=self.runner.max_num_seqs,
            max_num_batched_tokens=config.token_budget,
            max_model_len=self.setup.max_model_len,
            block_size=config.block_size,
            num_blocks=self.runner.num_blocks,
            enable_prefix_caching=prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            num_lookahead_tokens=self.runner.num_lookahead_tokens,
            max_loras=config.max_loras if config.enable_lora else None,
            kv_connector=self._scheduler_connector(),
            kv_windows=self.runner.kv_windows(),
            whole_images=self.runner.bidirectional_images,
        )

    def _scheduler_connector(self) -> KVConnector | None:
        """The KV connector's scheduler half, told what its worker half (the runner's) needs it to know."""
        worker, transfer = self.runner.kv_connector, self.config.kv_transfer
        if worker is None:
            return None
        context = replace(self.runner.kv_context, worker_info=worker.worker_info())
        return self.setup.registry.kv_connectors[transfer.kv_connector](
            transfer, KVConnectorRole.SCHEDULER, context
        )

    def _draft(self) -> tuple[EngineSetup, Any] | None:
        """The draft model's setup and weights when speculative_config asks for one: same platform, dtype,
        block size and attention backend as the target, and the same vocabulary (else a ConfigError)."""
        spec = self.config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        draft_config = self.config.replace(
            model=spec.model,
            revision=None,  # --revision and --tokenizer-revision are the target's; the draft's id is at main
            tokenizer=None,
            tokenizer_revision=None,
            gguf_file=None,
            quantization=None,
            speculative_config=None,
            dtype=dtype_name(self.setup.dtype),
            attention_backend=self.setup.backend.name,
            max_model_len=self.setup.max_model_len,
        )
        setup = resolve_engine(draft_config)
        tokenizer, weights = load_tokenizer_and_weights(setup)
        ours, theirs = self.setup.hf_config.vocab_size, setup.hf_config.vocab_size
        if ours != theirs or tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ConfigError(
                f"speculative_config.model {spec.model}: its vocabulary ({theirs} tokens) is not the target "
                f"model's ({ours} tokens); a draft model must share the target's tokenizer"
            )
        logger.info(
            "speculative decoding: draft model %s, %d tokens a step", spec.model, spec.num_speculative_tokens
        )
        return setup, weights

    # -- requests -------------------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (unless --generation-config pagellm)."""
        return SamplingParams(**self.default_params)

    def tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        """The prompt's text (if it came as text) and token ids (`Processor.tokenize`)."""
        return self.processor.tokenize(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        """Reject what cannot run, with a message that says what to change (`Processor.validate`)."""
        self.processor.validate(prompt_token_ids, params)

    def add_request(
        self,
        prompt: str | dict | list[int],
        params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> str:
        """Queue a request; returns its id (`request_id`, or one made here), which its outputs carry and
        `abort_request` takes. Raises ConfigError (nothing queued) for invalid input. With PoolingParams
        (runner="pooling"), an embedding request. `kv_transfer_params` (or the prompt dict's
        "kv_transfer_params", how AsyncLLM's callers pass it) is for the KV connector: disaggregated prefill.

        The scheduler and the runner know the request by an id of the engine's own, `<request_id>-<serial>`
        (`Request.request_id`), so an id used again as soon as its request finished is a new request there
        too, whatever of the old one the runner releases at the next step."""
        processed = self.process(prompt, params, kv_transfer_params)
        return self.add_processed(processed, request_id, priority, arrival_time, lora_request)

    def process(
        self,
        prompt: str | dict | list[int],
        params: SamplingParams | PoolingParams | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> ProcessedPrompt:
        """The prompt tokenized, its images read and its parameters checked (`Processor.process`): the
        validation is this processing, so a caller that checks many prompts before queueing any (`LLM`)
        hands the results to `add_processed` instead of processing each again."""
        if not isinstance(params, PoolingParams):
            params = params or self.default_sampling_params()
        return self.processor.process(prompt, params, kv_transfer_params)

    def add_processed(
        self,
        processed: ProcessedPrompt,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a prompt `process` returned (`add_request` says what the arguments mean)."""
        if lora_request is not None:
            self.runner.add_lora(lora_request)  # loads it now: a bad adapter fails here, alone
        serial = next(self._serials)
        request_id = request_id if request_id is not None else str(serial)
        if self.output_processor.has_request(request_id):
            raise ConfigError(f"request id {request_id!r} is already running")
        requests = self.processor.make_requests(
            f"{request_id}-{serial}", processed, priority, arrival_time, lora_request, request_id
        )
        self.output_processor.add(request_id, processed.prompt, requests, processed.params)
        for request in requests:
            self.scheduler.add_request(request)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | PoolingRequestOutput | None:
        """Abort a request (all its samples; `request_id`: the caller's) in any state; its KV blocks are freed
        at once, the runner's state of it at the next step."""
        for child_id in self.output_processor.child_ids(request_id):
            self.scheduler.abort_request(child_id)
        return self.output_processor.abort(request_id)

    def waits_for_idle(self) -> bool:
        """Whether work is put off until no request runs (a warm start's load of its saved compiled forward)."""
        return self.runner.compiler.waits_for_idle

    def on_idle(self) -> None:
        """No request runs: start the work put off until now (`waits_for_idle`)."""
        self.runner.compiler.on_idle()

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or KV transfers in flight (the loop steps until they end, then frees their blocks)."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_kv_transfers()

    # -- the loop ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self._failure is not None:
            raise self._failure
        out = self.scheduler.schedule()
        if out.is_empty and out.kv_connector_metadata is None and not (out.finished_ids or out.preempted):
            return []  # nothing to run, and nothing the runner must hear of
        try:
            result = self.runner.execute(out)
        except Exception as exc:
            self._check_ranks(exc)
            logger.exception("a step of %d requests failed; running them one at a time", len(out.scheduled))
            return self._step_one_by_one(out)
        outputs = self._update(out, result)
        if out.is_empty and out.kv_connector_metadata is not None and not result.kv_connector_output:
            time.sleep(_TRANSFER_POLL_S)  # only transfers in flight, none ended: wait a little, do not spin
        return outputs

    def _update(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        if result.kv_connector_output is not None:
            self.scheduler.update_kv_transfers(result.kv_connector_output)
        updated = self.scheduler.update_from_output(out, result.sampled, result.spec_token_ids)
        outputs, stopped = self.output_processor.process(updated, result)
        for request_id, stop_string in stopped:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED, stop_string)
        if self.scheduler.kv_connector is not None:  # what the connector returned when each finished (n = 1)
            finished = {r.external_request_id: r for r in updated if r.is_finished}
            for output in outputs:
                if output.finished and output.request_id in finished:
                    output.kv_transfer_params = finished[output.request_id].kv_transfer_output
        return outputs

    def _step_one_by_one(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Rerun a failed step's requests alone, so one whose parameters break the runner fails by itself
        (its output carries `error`) and the others go on. The scheduler has not moved yet: a failed step
        leaves nothing to undo."""
        outputs = []
        for request in out.scheduled:
            if request.is_finished:  # another sample of a request that failed in this loop
                continue
            rid = request.request_id
            alone = replace(
                out,
                scheduled=[request],
                num_scheduled_tokens={rid: out.num_scheduled_tokens[rid]},
                new_request_ids=out.new_request_ids & {rid},
                preempted=[],
                finished_ids=set(),
                block_ids={rid: out.block_ids[rid]},
                group_block_ids={rid: out.block_tables(rid)},
                total_num_scheduled_tokens=out.num_scheduled_tokens[rid],
                kv_connector_metadata=None,
            )
            try:
                result = self.runner.execute(alone)
            except Exception as exc:
                self._check_ranks(exc)
                outputs.append(self._fail(request, exc))
                continue
            outputs += self._update(alone, result)
        return outputs

    def _check_ranks(self, exc: Exception) -> None:
        """Raise RankFailure, for good, when a failed step means the model's ranks are gone."""
        if self.ranks is None:
            return
        failure = self.ranks.failure(exc)
        if failure is not None:
            self._failure = failure
            self._rank_release.failed = True
            logger.error("%s", failure)
            raise failure from exc

    def shutdown(self) -> None:
        """Stop the model's other ranks, if it has any (an engine without them needs no shutdown), a
        background compile still running, and close the KV connector's sockets and threads."""
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.compiler.stop()
        for connector in (
            getattr(getattr(self, name, None), "kv_connector", None) for name in ("runner", "scheduler")
        ):
            if connector is not None:
                connector.close()
        if self._rank_release is not None:
            self._rank_release()

    def _fail(self, request: Request, exc: Exception) -> RequestOutput:
        """End the request a failing sample belongs to (all its samples), saying why in `error`."""
        parent_id = request.external_request_id
        logger.error("request %s failed in the model runner; ending it alone", parent_id, exc_info=exc)
        output = self.abort_request(parent_id)
        output.error = f"the model runner failed on this request: {exc!r}"
        return output

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's blocks that no running request holds (e.g. before a benchmark run);
        returns how many blocks were dropped."""
        return self.scheduler.kv_cache_manager.pool.reset_prefix_cache()

    def stats(self) -> Any:
        return replace(
            self.scheduler.stats(),
            num_grammar_matchers_live=self.processor.grammar_matchers_live,
            forward_compiled=self.runner.forward is not self.runner.model,
            forward_regional=self.runner.forward is not self.runner.model and self.runner.compiler.regional,
            kernels_pending=self.runner.kernels_pending,
        )


class _RankRelease:
    """Stops an engine's other ranks once: from `shutdown()`, or from the engine's finalizer when nothing
    references the engine any more (it holds no reference to the engine, so it does not keep it alive)."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.stop: Callable[[], None] | None = None  # the driver's stop message, once the runner exists
        self.failed = False  # the ranks failed: do not wait on them

    def __call__(self) -> None:
        if self.ranks.closed:
            return
        if self.stop is not None and not self.failed:
            try:
                self.stop()
            except Exception:
                logger.debug("the ranks did not take the stop message", exc_info=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.ranks.close(wait=0.5 if self.failed else 10.0)
        self.stop = None


def _start_ranks(setup: EngineSetup) -> Ranks:
    """The model's other ranks, started the way `distributed_executor_backend` says."""
    if setup.config.distributed_executor_backend == "ray":
        return RayRanks(setup)
    return RankProcesses(setup)


def load_tokenizer_and_weights(setup: EngineSetup):
    """The tokenizer and the checkpoint's weights as the model loader reads them (`load_weights`)."""
    return load_tokenizer(setup.config.tokenizer or setup.source.directory), load_weights(setup)


def load_weights(setup: EngineSetup):
    """The checkpoint's weights as the model loader reads them (GGUF blocks as they are where the
    quantization keeps them)."""
    from pagellm.models.loader import iter_checkpoint_weights

    source = setup.source
    if setup.quant_method is not None and setup.quant_method.loads_gguf_blocks and source.gguf_original:
        from pagellm.models.gguf_checkpoint import iter_gguf_weights  # packed blocks straight from the file

        return iter_gguf_weights(source.gguf_original, setup.hf_config, raw_linear=True)
    if source.gguf_original:  # its float weights, converted the first time a start reads them
        from pagellm.core.paths import cache_dir
        from pagellm.models.gguf_checkpoint import gguf_checkpoint_weights

        with CoreYield(setup.kernels_pending):  # beside the kernels' build, as the load after it
            gguf_checkpoint_weights(source.gguf_original, cache_dir())
    split = setup.config.tensor_parallel_size * setup.config.pipeline_parallel_size > 1
    return iter_checkpoint_weights(source.directory, lazy=split)  # a rank reads only its part


def _eos_token_ids(setup: EngineSetup, tokenizer) -> set[int]:
    ids = set()
    for value in (getattr(setup.hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    generation = _generation_config(setup)
    if generation is not None:
        value = generation.eos_token_id
        ids.update([value] if isinstance(value, int) else list(value or []))
    return ids


def _generation_config(setup: EngineSetup):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(setup.source.directory)
    except OSError:
        return None


def _generation_defaults(setup: EngineSetup) -> dict[str, Any]:
    """Sampling defaults the model's authors set in generation_config.json, as vLLM applies them."""
    generation = _generation_config(setup)
    if generation is None:
        return {}
    diff = generation.to_diff_dict()
    return {k: diff[k] for k in _GENERATION_DEFAULTS if k in diff and diff[k] is not None}


def _check_kv_transfer(setup: EngineSetup) -> None:
    """Refuse a kv_transfer_config that cannot work, before any weight loads."""
    config, transfer = setup.config, setup.config.kv_transfer
    if transfer is None:
        return
    known = setup.registry.kv_connectors
    if transfer.kv_connector not in known:
        raise ConfigError(
            f"kv_transfer_config.kv_connector: no connector {transfer.kv_connector!r} is installed; "
            f"installed: {', '.join(sorted(known)) or 'none'} (see `pagellm plugins`)"
        )
    known[transfer.kv_connector].check_config(transfer)
    refused = [
        (config.tensor_parallel_size * config.pipeline_parallel_size > 1, "tensor or pipeline parallelism"),
        (
            config.speculative is not None and config.speculative.method in ("draft_model", "eagle3", "mtp"),
            "a draft model, an EAGLE-3 head or MTP (their KV is not transferred)",
        ),
        (not config.enable_prefix_caching, "prefix caching off (loaded KV is found as prefix-cache hits)"),
        (getattr(config, "runner", "generate") != "generate", "runner='pooling'"),
        (
            setup.kv_layout is not None and setup.kv_layout.num_groups > 1,
            f"a model whose layers keep their KV in several groups ({setup.kv_layout and setup.kv_layout.describe()})",
        ),
    ]
    for refuse, what in refused:
        if refuse:
            raise ConfigError(f"kv_transfer_config cannot run with {what} yet; leave one of them out")
