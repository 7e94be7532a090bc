"""The transformers peer: `generate` on static batches, as the bench README defines it.

Requests are taken in order in batches of a fixed size, left-padded; each batch runs greedily to its
longest requested output (min_new_tokens = max_new_tokens, so EOS cannot end it early), but only the
tokens each request asked for count. The same weights are loaded in the same dtype as pagellm's, on the
engine's device (a GPU engine against a CPU peer would be no comparison).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pagellm.bench.common import ThroughputResult
from pagellm.bench.workloads import Workload


def load_transformers_model(
    model: str, gguf_file: str | None, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Any:
    """The model pagellm was given (`--model`, `--gguf-file`) as transformers loads it, on `device`; a GGUF
    file is dequantized into dense `dtype` weights, as pagellm does."""
    from transformers import AutoModelForCausalLM, GgufConfig

    if model.endswith(".gguf"):
        model, gguf_file = os.path.dirname(os.path.abspath(model)), os.path.basename(model)
    if gguf_file:
        loaded = AutoModelForCausalLM.from_pretrained(
            model, gguf_file=gguf_file, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
        )
    else:
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    return loaded.to(device)


def _pad_id(model: Any) -> int:
    for value in (model.generation_config.pad_token_id, model.generation_config.eos_token_id):
        if isinstance(value, int):
            return value
        if value:
            return int(value[0])
    return 0


def _generate(model: Any, prompts: Sequence[list[int]], new_tokens: int, pad_id: int) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )


def run_static_batches(
    model: Any, workload: Workload, batch_size: int, name: str = "transformers"
) -> ThroughputResult:
    pad_id = _pad_id(model)
    _generate(model, [list(range(1, 17))], 4, pad_id)  # warm-up, as pagellm gets one
    start = time.perf_counter()
    for i in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[i : i + batch_size]
        _generate(model, prompts, max(workload.output_lens[i : i + batch_size]), pad_id)
    if model.device.type != "cpu":  # queued device work counts
        getattr(torch, model.device.type).synchronize()
    elapsed = time.perf_counter() - start
    return ThroughputResult(
        engine=f"{name} (batch {batch_size})",
        num_requests=workload.num_requests,
        input_tokens=workload.input_tokens,
        output_tokens=workload.output_tokens,
        elapsed_s=elapsed,
        extra={"batch_size": batch_size, "dtype": str(model.dtype).removeprefix("torch.")},
    )


def run_transformers(
    model: Any,
    workload: Workload,
    batch_sizes: Sequence[int],
    on_result: Callable[[ThroughputResult], None] | None = None,
    name: str = "transformers",
) -> ThroughputResult:
    """The best (highest output tok/s) of a static-batch run per batch size; every size's rate is kept.

    `on_result` sees each batch size's result as soon as it is measured; `name` heads each result's
    engine name."""
    runs = []
    for batch_size in batch_sizes:
        runs.append(run_static_batches(model, workload, batch_size, name))
        if on_result is not None:
            on_result(runs[-1])
    best = max(runs, key=lambda r: r.output_tok_s)
    best.extra["output_tok_s_by_batch_size"] = {r.extra["batch_size"]: r.output_tok_s for r in runs}
    return best
