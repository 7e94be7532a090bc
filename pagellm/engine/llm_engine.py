"""`LLMEngine`: the synchronous engine loop that `LLM` and `AsyncLLM` drive.

add_request -> processor (tokenize, validate) -> scheduler -> each step(): schedule, run the model,
update the scheduler, detokenize and apply stop strings -> RequestOutputs.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from typing import Any

from pagellm.core.config import EngineConfig
from pagellm.core.dtypes import dtype_name
from pagellm.core.errors import ConfigError
from pagellm.core.platform import GiB
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.outputs import RequestOutput
from pagellm.engine.request import Request, RequestStatus
from pagellm.engine.scheduler import Scheduler
from pagellm.engine.setup import resolve_engine
from pagellm.lora.request import LoRARequest
from pagellm.sampling.params import SamplingParams
from pagellm.structured_output import grammar
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.step import EngineSetup, SchedulerOutput, StepResult

logger = logging.getLogger("pagellm")

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class PromptTooLongError(ConfigError):
    """A prompt (plus any requested output) does not fit the model's context."""


class LLMEngine:
    def __init__(self, config: EngineConfig):
        started = time.monotonic()
        self.config = config
        self.setup: EngineSetup = resolve_engine(config)
        for line in self.setup.explanation:
            logger.info(line)
        self.tokenizer, weights = _load_tokenizer_and_weights(self.setup)
        self.eos_token_ids = _eos_token_ids(self.setup, self.tokenizer)
        self.default_params = _generation_defaults(self.setup) if config.generation_config == "auto" else {}
        self.runner = ModelRunner(self.setup, weights, self.eos_token_ids, self._draft())
        self.max_model_len = self.setup.max_model_len
        budget = config.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, config.max_num_seqs)
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            num_blocks=self.runner.num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            num_lookahead_tokens=self.runner.num_lookahead_tokens,
            max_loras=config.max_loras if config.enable_lora else None,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._grammar_compiler: grammar.GrammarCompiler | None = None
        parser = self.setup.reasoning_parser
        # a grammar applies after these tokens: the end of the reasoning, when a reasoning parser is set
        self._reasoning_end = (
            self.tokenizer.encode(parser.end_tag, add_special_tokens=False) if parser else []
        )
        self._ids = itertools.count()
        usable_tokens = (self.runner.num_blocks - 1) * config.block_size
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
            usable_tokens / self.max_model_len,
            self.max_model_len,
        )

    def _draft(self) -> tuple[EngineSetup, Any] | None:
        """The draft model's setup and weights when speculative_config asks for one: same platform, dtype,
        block size and attention backend as the target, and the same vocabulary (else a ConfigError)."""
        spec = self.config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        draft_config = self.config.replace(
            model=spec.model,
            tokenizer=None,
            gguf_file=None,
            quantization=None,
            speculative_config=None,
            dtype=dtype_name(self.setup.dtype),
            attention_backend=self.setup.backend.name,
            max_model_len=self.setup.max_model_len,
        )
        setup = resolve_engine(draft_config)
        tokenizer, weights = _load_tokenizer_and_weights(setup)
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
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, [int(t) for t in prompt]

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Reject what cannot run, with a message that says what to change."""
        if not prompt_token_ids:
            raise ConfigError("the prompt is empty; give at least one token")
        vocab = self.setup.hf_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(
                f"prompt token id {bad[0]} is out of range for the vocabulary of {vocab} tokens"
            )
        params.validate_token_ids(vocab)
        if params.structured_outputs is not None:
            grammar.check(params.structured_outputs)
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {n} tokens but this model's context is {self.max_model_len} tokens "
                f"(max_model_len), which must also hold at least one output token; shorten the prompt"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {n} tokens and max_tokens is {params.max_tokens}, but the context is "
                f"{self.max_model_len} tokens (max_model_len); lower max_tokens to at most {self.max_model_len - n} "
                f"or shorten the prompt"
            )

    def add_request(
        self,
        prompt: str | dict | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ConfigError (nothing queued) for invalid input."""
        params = params or self.default_sampling_params()
        text, prompt_token_ids = self.tokenize(prompt)
        self.validate(prompt_token_ids, params)
        if lora_request is not None:
            self.runner.add_lora(lora_request)  # loads it now: a bad adapter fails here, alone
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor.parents:
            raise ConfigError(f"request id {request_id!r} is already running")
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.for_sample(i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(
                Request(
                    child_id,
                    prompt_token_ids,
                    child_params,
                    self.eos_token_ids,
                    arrival_time,
                    priority,
                    lora_request,
                )
            )
        if params.structured_outputs is not None:
            for child in children:
                child.grammar = self._grammars().request_grammar(
                    params.structured_outputs, self._reasoning_end
                )
        self.runner.add_requests({child.request_id: child.sampling_params for child in children})
        self.output_processor.add(request_id, text, children, params)
        for child in children:
            self.scheduler.add_request(child)
        return request_id

    def _grammars(self) -> grammar.GrammarCompiler:
        """The structured-output compiler, made on the first request with a grammar."""
        if self._grammar_compiler is None:
            self._grammar_compiler = grammar.GrammarCompiler(
                self.tokenizer, self.setup.hf_config.vocab_size, self.eos_token_ids
            )
        return self._grammar_compiler

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its samples) in any state; its KV blocks are freed at once."""
        for child_id in self.output_processor.child_ids(request_id):
            self.scheduler.abort_request(child_id)
        self.runner.release(self.output_processor.child_ids(request_id))
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        self.runner.forget(out.preempted)
        self.runner.release(out.finished_ids)
        if out.is_empty:
            return []
        try:
            result = self.runner.execute(out)
        except Exception:
            logger.exception("a step of %d requests failed; running them one at a time", len(out.scheduled))
            return self._step_one_by_one(out)
        return self._update(out, result)

    def _update(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        updated = self.scheduler.update_from_output(out, result.sampled, result.spec_token_ids)
        outputs, stopped = self.output_processor.process(updated, result.logprobs, result.prompt_logprobs)
        for request_id, stop_string in stopped:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED, stop_string)
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
                total_num_scheduled_tokens=out.num_scheduled_tokens[rid],
            )
            try:
                result = self.runner.execute(alone)
            except Exception as exc:
                outputs.append(self._fail(rid, exc))
                continue
            outputs += self._update(alone, result)
        return outputs

    def _fail(self, child_id: str, exc: Exception) -> RequestOutput:
        """End the request a failing sample belongs to (all its samples), saying why in `error`."""
        parent_id = self.output_processor.child_to_parent[child_id][0].request_id
        logger.error("request %s failed in the model runner; ending it alone", parent_id, exc_info=exc)
        output = self.abort_request(parent_id)
        output.error = f"the model runner failed on this request: {exc!r}"
        return output

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's blocks that no running request holds (e.g. before a benchmark run);
        returns how many blocks were dropped."""
        return self.scheduler.kv_cache_manager.pool.reset_prefix_cache()

    def stats(self) -> Any:
        return self.scheduler.stats()


def _load_tokenizer_and_weights(setup: EngineSetup):
    from transformers import AutoTokenizer

    from pagellm.models.loader import iter_checkpoint_weights

    source = setup.source
    tokenizer = AutoTokenizer.from_pretrained(setup.config.tokenizer or source.directory)
    if setup.quant_method is not None and setup.quant_method.loads_gguf_blocks and source.gguf_original:
        from pagellm.models.gguf import iter_gguf_weights  # packed blocks straight from the file

        return tokenizer, iter_gguf_weights(source.gguf_original, setup.hf_config, raw_linear=True)
    return tokenizer, iter_checkpoint_weights(source.directory)


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
