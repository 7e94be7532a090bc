"""`LLM`: the offline API, called the way vLLM users call it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagellm.core.config import EngineConfig
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.outputs import RequestOutput
from pagellm.lora.request import LoRARequest
from pagellm.sampling.params import SamplingParams

Prompt = str | dict[str, Any]
Message = dict[str, Any]


class LLM:
    """LLM(model=..., dtype=..., device=..., attention_backend=..., block_size=..., ...): every keyword is an
    EngineConfig field (the same names as the CLI flags)."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

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
        """Generate for every prompt (a string, or {"prompt_token_ids": [...]}); outputs in prompt order.
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
        for prompt, params in zip(prompts, params_list, strict=True):
            self.engine.validate(self.engine.tokenize(prompt)[1], params)
        for lora in {lora for lora in loras if lora is not None}:
            self.engine.runner.add_lora(lora)
        ids = [
            self.engine.add_request(
                prompt, params, priority=priority[i] if priority else 0, lora_request=loras[i]
            )
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True))
        ]
        return self._run(ids, use_tqdm)

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
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(c, chat_template, add_generation_prompt)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

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
