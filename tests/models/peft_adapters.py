"""Random PEFT LoRA adapters for tiny checkpoints, peft's merged model beside them as the oracle, and an engine
that puts an adapter on every request, so that parity.assert_greedy_parity can compare the two."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagellm import LLM, LoRARequest, SamplingParams
from pagellm.core.errors import ConfigError

EVERY_PROJECTION = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Llama's attention and gated MLP projections: every LoRA target of a Llama-like decoder layer."""


def make_peft_adapter(
    base: Path, out: Path, targets: list[str], rank: int = 4, merged: bool = True, seed: int = 0
) -> Path:
    """A PEFT adapter on `targets` of `base` in `out / "adapter"` (its B drawn, not zero, so it changes the
    outputs); with `merged`, peft's merge_and_unload() model and the tokenizer in `out / "merged"`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5 / rank)
    model.save_pretrained(out / "adapter")
    if merged:
        model.merge_and_unload().save_pretrained(out / "merged")
        AutoTokenizer.from_pretrained(base).save_pretrained(out / "merged")
    return out / "adapter"


class WithAdapter:
    """`llm` with `lora` on every request: what assert_greedy_parity generates with."""

    def __init__(self, llm: LLM, lora: LoRARequest):
        self.llm, self.lora, self.engine = llm, lora, llm.engine

    def generate(self, prompts, params: SamplingParams, use_tqdm: bool = False):
        return self.llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=self.lora)


def lora_engine(
    base: Path, out: Path, targets: list[str], seed: int = 0, num_kv_blocks: int = 200, max_lora_rank: int = 8
) -> WithAdapter:
    """A rank-4 adapter on `targets` (make_peft_adapter: peft's merged model in `out / "merged"`) and a
    LoRA-enabled float32 engine on `base` that puts it on every request."""
    adapter = make_peft_adapter(base, out, targets, seed=seed)
    llm = LLM(
        str(base),
        dtype="float32",
        num_kv_blocks=num_kv_blocks,
        max_model_len=400,
        enable_lora=True,
        max_lora_rank=max_lora_rank,
    )
    return WithAdapter(llm, LoRARequest("a", 1, str(adapter)))


def assert_adapter_refused(llm: LLM, adapter: Path, prompts: list[list[int]], module: str) -> None:
    """An adapter on a module that is no LoRA target of pagellm's is refused when it is added, naming it."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    few = [{"prompt_token_ids": p} for p in prompts[:3]]
    with pytest.raises(ConfigError, match=module):
        llm.generate(few, params, use_tqdm=False, lora_request=LoRARequest("b", 2, str(adapter)))


def assert_adapter_changes_outputs(engine: WithAdapter, prompts: list[list[int]]) -> None:
    """Greedy tokens with the adapter differ from the base model's: a parity check that would pass with the
    adapter ignored is no check."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    few = [{"prompt_token_ids": p} for p in prompts[:3]]
    tokens = [
        [o.outputs[0].token_ids for o in engine.llm.generate(few, params, use_tqdm=False, lora_request=lora)]
        for lora in (engine.lora, None)
    ]
    assert tokens[0] != tokens[1]
