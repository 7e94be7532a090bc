"""`pagellm bench images`: I1 (shared/bench/README.md), one image and a W1-like text per request, on a
vision-language model (default: model V, LLaVA's layout at a tiny width), every request queued at once,
greedy, EOS ignored; beside transformers' `generate` on the same requests (one at a time and in static
batches) with `--compare transformers`.

Reported: requests/s, output tokens/s, TTFT (mean and p50, from the moment all requests were queued), and
the vision encoder's share of the engine's step time. The floor adds the encoder's work (its FLOPs counted
as it runs, its weights read once per encoding call) to the decoder's recorded steps."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.bench.common import BenchArgs, ThroughputResult, echo, progress, table, with_floor, write_json
from pagellm.bench.floor import Floor, Machine, ModelShape, Work, format_floor
from pagellm.bench.steps import StepRecorder, records_work
from pagellm.bench.workloads import ImageWorkload, i1
from pagellm.engine.llm import LLM
from pagellm.sampling.params import SamplingParams

COLUMNS = (
    ("engine", "engine", "{}"),
    ("requests", "num_requests", "{}"),
    ("output tokens", "output_tokens", "{}"),
    ("seconds", "elapsed_s", "{:.1f}"),
    ("requests/s", "requests_s", "{:.3f}"),
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("mean TTFT s", "mean_ttft_s", "{:.2f}"),
    ("p50 TTFT s", "p50_ttft_s", "{:.2f}"),
    ("encoder share", "encoder_share", "{:.1%}"),
    ("of floor", "fraction_of_floor", "{:.1%}"),
)


@dataclass(kw_only=True)
class ImagesArgs(BenchArgs):
    """I1's size and its peers."""

    model: str = "V"
    num_prompts: int = 64
    compare: tuple[str, ...] = ()
    peer_batch_sizes: tuple[int, ...] = (1, 8)


def main(args: ImagesArgs) -> dict[str, Any]:
    config = args.engine_config()
    llm = LLM(**dataclasses.asdict(config))
    if llm.engine.processor.images is None:
        raise SystemExit(f"pagellm bench images: {config.model} takes no images")
    processor = llm.engine.processor.images.processor
    size = llm.engine.setup.model_config.vision_config.image_size
    workload = i1(processor.tokenizer, args.num_prompts, image_size=size)
    echo(f"I1: {workload.num_requests} requests, {size}x{size} images", err=True)
    sample = _warm_up(llm, workload)
    machine = args.llm_machine(llm)
    results = [run_pagellm(llm, workload, sample, machine)]
    progress(results[-1])
    if "transformers" in args.compare:
        peer = _transformers(config.model, llm.engine.setup.dtype, llm.engine.runner.device)
        del llm
        for batch_size in args.peer_batch_sizes:
            results.append(run_transformers(*peer, workload, batch_size))
            progress(results[-1])
    rows = [with_floor(_row(r)) for r in results]
    echo(table(rows, COLUMNS))
    echo(format_floor(results[0].extra["floor"], "pagellm floor"))
    sections = {"workload": workload.describe(), "results": rows}
    write_json(args.output_json, "images", config, **sections)
    return sections


def _row(result: ThroughputResult) -> dict[str, Any]:
    return {**result.as_dict(), "requests_s": result.num_requests / result.elapsed_s}


def _prompts(workload: ImageWorkload) -> list[dict[str, Any]]:
    return [
        {"prompt": t, "multi_modal_data": {"image": i}}
        for t, i in zip(workload.texts, workload.images, strict=True)
    ]


def _warm_up(llm: LLM, workload: ImageWorkload) -> dict[str, torch.Tensor]:
    """One request with a gray image (not one of the workload's, so the prefix cache gains nothing);
    returns that image as the encoder reads it, on the device."""
    from PIL import Image

    gray = Image.new("RGB", workload.images[0].size, (128, 128, 128))
    prompt = {"prompt": workload.texts[0], "multi_modal_data": {"image": gray}}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    (image,) = llm.engine.processor.images.process(workload.texts[0], [gray])[1]
    return {k: v.to(llm.engine.runner.device) for k, v in image.data.items()}


def run_pagellm(
    llm: LLM, workload: ImageWorkload, sample: dict[str, torch.Tensor], machine: Machine | None = None
) -> ThroughputResult:
    """Every request in one `LLM.generate` call, timed; the encoder's time and work counted as it runs
    (`sample`: one image as the encoder reads it, for its FLOPs)."""
    counter = EncoderCounter(llm, sample)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    with counter, StepRecorder(llm.engine) as recorder:
        start = time.perf_counter()
        outputs = llm.generate(_prompts(workload), params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    ttfts = [o.metrics.time_to_first_token for o in outputs if o.metrics is not None]
    step_seconds = sum(s.seconds for s in recorder.steps)
    result = ThroughputResult(
        engine="pagellm",
        num_requests=len(outputs),
        input_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        elapsed_s=elapsed,
        extra={
            "mean_ttft_s": statistics.fmean(ttfts),
            "p50_ttft_s": statistics.median(ttfts),
            "encoder_s": counter.seconds,
            "encoder_share": counter.seconds / step_seconds,
            "images_encoded": counter.images,
            "steps": len(recorder.steps),
        },
    )
    if machine is not None:
        work = records_work(ModelShape.from_llm(llm), recorder.steps) + counter.work
        result.extra["floor"] = Floor(work, machine).report(elapsed, result.output_tokens)
    return result


class EncoderCounter:
    """While active: the engine's image encoder (`EncoderCache.encode`, compiled or not) timed, the device
    synchronised after each call. Its work: FLOPs per image counted once, eagerly, from the shapes that run
    through its linears, convolutions and attention (hooks would not see inside a compiled graph), and its
    weights read once per call."""

    def __init__(self, llm: LLM, sample: dict[str, torch.Tensor]):
        runner = llm.engine.runner
        self.cache, self.platform = runner.encoder_cache, llm.engine.setup.platform
        self.seconds, self.images, self.calls = 0.0, 0, 0
        modules = runner.model.image_encoder_modules()
        self.weight_bytes = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
        self.flops_per_image = _count_flops(runner.model, modules, sample)

    @property
    def work(self) -> Work:
        return Work(
            linear_flops=self.flops_per_image * self.images, weight_bytes=self.weight_bytes * self.calls
        )

    def __enter__(self) -> EncoderCounter:
        encode = self.cache.encode

        def timed(images):
            began = time.perf_counter()
            out = encode(images)
            self.platform.synchronize()
            self.seconds += time.perf_counter() - began
            self.images += len(images)
            self.calls += 1
            return out

        self.cache.encode = timed
        self._encode = encode
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cache.encode = self._encode


@torch.inference_mode()
def _count_flops(model: Any, modules: list[torch.nn.Module], sample: dict[str, torch.Tensor]) -> float:
    """FLOPs of one eager `encode_images` call on `sample`: linears, convolutions and non-causal attention
    over [B, S, hidden] (scores and the weighted sum)."""
    flops = 0.0

    def count(module: torch.nn.Module, inputs: tuple, output: Any) -> None:
        nonlocal flops
        if isinstance(module, torch.nn.Conv2d):
            kernel = module.in_channels * module.kernel_size[0] * module.kernel_size[1] // module.groups
            flops += 2 * output.numel() * kernel
        elif hasattr(module, "in_features"):
            flops += 2 * inputs[0].numel() // module.in_features * module.in_features * module.out_features
        elif inputs and inputs[0].dim() == 3:
            batch, length, hidden = inputs[0].shape
            flops += 4 * batch * length * length * hidden

    hooks = [
        m.register_forward_hook(count)
        for part in modules
        for m in part.modules()
        if hasattr(m, "in_features")
        or isinstance(m, torch.nn.Conv2d)
        or type(m).__name__.endswith("Attention")
    ]
    try:
        model.encode_images([sample])
    finally:
        for hook in hooks:
            hook.remove()
    return flops


def _transformers(model: str, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    peer = AutoModelForImageTextToText.from_pretrained(model, dtype=dtype).to(device).eval()
    processor = AutoProcessor.from_pretrained(model)
    processor.tokenizer.padding_side = "left"
    return peer, processor


class _FirstToken:
    """A generate streamer that notes when the first new tokens come (its first call is the prompt)."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


@torch.no_grad()
def run_transformers(
    model: Any, processor: Any, workload: ImageWorkload, batch_size: int
) -> ThroughputResult:
    """Static batches in request order, each to its longest output (min_new_tokens: EOS cannot end it);
    only the tokens each request asked for count. TTFT from the start, as pagellm's: a later batch waits."""
    pad = processor.tokenizer.pad_token_id
    start, ttfts = time.perf_counter(), []
    for i in range(0, workload.num_requests, batch_size):
        texts, images = workload.texts[i : i + batch_size], workload.images[i : i + batch_size]
        new_tokens = max(workload.output_lens[i : i + batch_size])
        inputs = processor(text=texts, images=images, padding=True, return_tensors="pt").to(model.device)
        streamer = _FirstToken()
        model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            streamer=streamer,
        )
        ttfts += [streamer.first - start] * len(texts)
    elapsed = time.perf_counter() - start
    return ThroughputResult(
        engine=f"transformers (batch {batch_size})",
        num_requests=workload.num_requests,
        input_tokens=0,
        output_tokens=workload.output_tokens,
        elapsed_s=elapsed,
        extra={
            "batch_size": batch_size,
            "mean_ttft_s": statistics.fmean(ttfts),
            "p50_ttft_s": statistics.median(ttfts),
        },
    )
