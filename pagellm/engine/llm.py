"""`LLM`: the offline API, called the way vLLM users call it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagellm.core.config import EngineConfig
from pagellm.core.pooling import PoolingParams
from pagellm.engine import beam_search as beams
from pagellm.engine.data_parallel import DataParallelClient, check_data_parallel
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.outputs import PoolingRequestOutput, RequestOutput
from pagellm.lora.request import LoRARequest
from pagellm.multimodal import load_image
from pagellm.multimodal.chat import has_images, split_images
from pagellm.multimodal.limits import media_limits
from pagellm.sampling.params import BeamSearchParams, SamplingParams

Prompt = str | dict[str, Any]
Message = dict[str, Any]


class LLM:
    """LLM(model=..., dtype=..., device=..., attention_backend=..., block_size=..., ...): every keyword is an
    EngineConfig field (the same names as the CLI flags).

    `self.engine` is the `LLMEngine`, stepped here; with `data_parallel_size` N > 1, a `DataParallelClient`
    over N engine processes that makes the same calls (call `shutdown()` to stop them before exit)."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        check_data_parallel(config)
        self.media_limits = media_limits(config)  # where LLM.chat's image URLs may come from
        self.engine: LLMEngine | DataParallelClient = (
            DataParallelClient(config) if config.data_parallel_size > 1 else LLMEngine(config)
        )

    def shutdown(self) -> None:
        """Stop the engine's other processes: data-parallel engines, tensor/pipeline-parallel ranks (they
        also stop when this process exits); nothing to do for one engine in this process."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's call): later requests recompute every prompt."""
        self.engine.reset_prefix_cache()
        return True

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, {"prompt_token_ids": [...]}, or {"prompt": text,
        "multi_modal_data": {"image": PIL image or a list}} for a model that takes images: the text holds
        the model's image placeholder where each image goes); outputs in prompt order.
        `lora_request`: one adapter for all prompts, or one (or None) per prompt.

        Every prompt (and adapter) is validated before any runs, so one bad prompt fails the call with
        nothing queued."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.engine.default_sampling_params()
        params_list = _one_each(sampling_params, SamplingParams, len(prompts), "sampling_params")
        loras = _one_each(lora_request, LoRARequest, len(prompts), "lora_request")
        processed = self._process_all(prompts, params_list, loras)
        ids = [self._add(item, priority[i] if priority else 0, loras[i]) for i, item in enumerate(processed)]
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Embed every prompt (a string, token ids in {"prompt_token_ids": [...]}) with an engine started
        with runner="pooling"; outputs in prompt order, each vector in `.outputs.embedding`. The prompts
        share the scheduler and its batches; nothing is generated. `pooling_params`: one for all prompts or
        one each (`dimensions`, `normalize`).

        Every prompt is validated before any runs, so one bad prompt fails the call with nothing queued."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = _one_each(
            pooling_params or PoolingParams(), PoolingParams, len(prompts), "pooling_params"
        )
        loras = _one_each(lora_request, LoRARequest, len(prompts), "lora_request")
        processed = self._process_all(prompts, params_list, loras)
        ids = [self._add(item, 0, loras[i]) for i, item in enumerate(processed)]
        return self._run(ids, use_tqdm)

    def _process_all(self, prompts: list, params_list: list, loras: list) -> list:
        """Every request processed (and its adapter loaded) before any is queued, so one bad prompt fails
        the call with nothing queued. In this process the processing is the validation and its results are
        queued as they are (`LLMEngine.add_processed`); data-parallel engines process their prompts
        themselves, so they are checked there first (`DataParallelClient.validate_all`) and sent as given."""
        if isinstance(self.engine, DataParallelClient):
            self.engine.validate_all(prompts, params_list, loras)
            return list(zip(prompts, params_list, strict=True))
        processed = [
            self.engine.process(prompt, params) for prompt, params in zip(prompts, params_list, strict=True)
        ]
        for lora in {lora for lora in loras if lora is not None}:
            self.engine.runner.add_lora(lora)
        return processed

    def _add(self, item: Any, priority: int, lora: LoRARequest | None) -> str:
        """Queue one result of `_process_all`."""
        if isinstance(self.engine, DataParallelClient):
            prompt, params = item
            return self.engine.add_request(prompt, params, priority=priority, lora_request=lora)
        return self.engine.add_processed(item, priority=priority, lora_request=lora)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
        use_tqdm: bool = False,
    ) -> list[beams.BeamSearchOutput]:
        """Beam search (vLLM's call): for each prompt, the `params.beam_width` best sequences, best first,
        as transformers' `generate(num_beams=...)` finds them (`BeamSearchParams` says how they rank).

        Each step runs every live beam of every prompt as a one-token request (`generate`); the prefix
        cache serves what the beams share, so a step computes about one token's KV per beam."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        tokenizer = self.get_tokenizer()
        ids = [beams.prompt_token_ids(p, tokenizer) for p in prompts]
        for prompt in ids:
            beams.check_fits(prompt, params.max_tokens, self.engine.max_model_len)
        if isinstance(self.engine, DataParallelClient):
            eos = self.engine.engines.facts.eos_token_ids
        else:
            eos = self.engine.eos_token_ids

        def step(sequences: list[list[int]], k: int) -> list[beams.TopLogprobs]:
            outputs = self.generate(
                [{"prompt_token_ids": s} for s in sequences],
                beams.step_params(k),
                use_tqdm=False,
                lora_request=lora_request,
            )
            return [beams.next_token_logprobs(o) for o in outputs]

        bar = tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm, unit="step")
        try:
            return beams.beam_search(ids, params, eos, step, tokenizer, on_step=lambda: bar.update(1))
        finally:
            bar.close()

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, using the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self._chat_prompt(c, chat_template, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _chat_prompt(
        self, conversation: list[Message], chat_template: str | None, add_generation_prompt: bool
    ):
        """The engine's prompt for a conversation: its token ids, or, with image parts (`image_url` with a
        data:, http(s): or allowed local URL; `image_pil` with a PIL image), the rendered text and the
        images, which the engine's processor expands to the images' tokens."""
        if not has_images(conversation):
            return {
                "prompt_token_ids": self.apply_chat_template(
                    conversation, chat_template, add_generation_prompt
                )
            }
        messages, sources = split_images(conversation)
        text = self.engine.tokenizer.apply_chat_template(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        images = [load_image(s.source, self.media_limits, field_hint=s.field) for s in sources]
        return {"prompt": text, "multi_modal_data": {"image": images}, "add_special_tokens": False}

    def apply_chat_template(
        self,
        conversation: list[Message],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        ids = self.engine.tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm, unit="req")
        try:
            while len(finished) < len(wanted):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in wanted - set(finished):
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[i] for i in request_ids]


def _one_each(value: Any, kind: type, n: int, name: str) -> list:
    """One value for every prompt: `value` repeated when it is a single `kind` (or None), else its items,
    which must be one per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"got {len(values)} {name} for {n} prompts; pass one or one each")
    return values
