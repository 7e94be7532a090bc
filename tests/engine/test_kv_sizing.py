"""KV-cache sizing on a device with memory of its own (issue 17): the model runner profiles a dummy step at
the largest size and leaves free torch's peak plus the memory outside torch's allocator, as vLLM does.
Tested with an accelerator simulated on the host CPU whose memory counters the test drives."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sim_platforms import SimAccelerator
from tiny import make_tiny_checkpoint

from pagellm import LLM
from pagellm.engine import setup
from pagellm.models.llama import LlamaForCausalLM
from pagellm.platforms import cuda, xpu
from pagellm.platforms.cpu import CpuPlatform
from pagellm.plugins import load_plugins
from pagellm.sampling.params import SamplingParams

MiB = 1 << 20
WEIGHTS = 20 * MiB  # what the simulated allocator holds before the dummy step
PER_TOKEN = 16 << 10  # activation bytes the simulated forward allocates per token
OUTSIDE = 3 * MiB  # the simulated device's memory outside torch's allocator


class ProfiledAccelerator(SimAccelerator):
    """Runs on the host CPU, measures its memory like a device of its own (64 MiB, 16 MiB in use) and has
    a peak counter, raised by the model's forward through `Spy`."""

    name = "profiled_accel"
    peak = 0
    resets = 0

    @classmethod
    def reset_peak_memory(cls, index: int = 0) -> None:
        cls.resets += 1
        cls.peak = WEIGHTS

    @classmethod
    def peak_memory_allocated(cls, index: int = 0) -> int:
        return cls.peak

    @classmethod
    def non_torch_memory(cls, index: int = 0) -> int:
        return OUTSIDE


class Spy:
    """Records the tokens of each forward and the rows of each logits call, and raises the simulated
    peak by the forward's activations."""

    def __init__(self, monkeypatch):
        self.forwards: list[tuple[int, int]] = []  # (tokens, resets of the peak counter before it)
        self.logit_rows: list[int] = []
        forward, compute_logits = LlamaForCausalLM.forward, LlamaForCausalLM.compute_logits

        def spy_forward(model, input_ids, positions):
            self.forwards.append((input_ids.shape[0], ProfiledAccelerator.resets))
            ProfiledAccelerator.peak += input_ids.shape[0] * PER_TOKEN
            return forward(model, input_ids, positions)

        def spy_logits(model, hidden):
            self.logit_rows.append(hidden.shape[0])
            return compute_logits(model, hidden)

        monkeypatch.setattr(LlamaForCausalLM, "forward", spy_forward)
        monkeypatch.setattr(LlamaForCausalLM, "compute_logits", spy_logits)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("sizing"))


@pytest.fixture
def accelerator(monkeypatch):
    registry = load_plugins()
    platforms = {**registry.platforms, ProfiledAccelerator.name: ProfiledAccelerator}
    monkeypatch.setattr(setup, "load_plugins", lambda: dataclasses.replace(registry, platforms=platforms))
    monkeypatch.setattr(ProfiledAccelerator, "resets", 0)
    monkeypatch.setattr(ProfiledAccelerator, "peak", 0)


def _llm(model_dir, device: str, **kwargs) -> LLM:
    return LLM(
        str(model_dir),
        device=device,
        dtype="float32",
        max_model_len=256,
        attention_backend="TORCH_SDPA",
        enforce_eager=True,
        **kwargs,
    )


@pytest.mark.parametrize("chunked, step_tokens", [(True, 96), (False, 256)])
def test_the_kv_cache_leaves_free_the_profiled_peak_of_the_largest_step(
    model_dir, accelerator, monkeypatch, chunked, step_tokens
):
    spy = Spy(monkeypatch)
    llm = _llm(
        model_dir,
        ProfiledAccelerator.name,
        gpu_memory_utilization=0.5,
        max_num_seqs=64,
        max_num_batched_tokens=96,
        enable_chunked_prefill=chunked,
    )
    # one dummy forward at the scheduler's largest step (the token budget, or a whole prompt without
    # chunked prefill), after the peak counter was reset; then the logits of max_num_seqs rows
    assert spy.forwards == [(step_tokens, 1)]
    assert spy.logit_rows == [64]
    runner = llm.engine.runner
    peak = WEIGHTS + step_tokens * PER_TOKEN + OUTSIDE
    assert runner.num_blocks == (32 * MiB - peak) // runner.block_bytes()
    # below both what `memory_in_use` gave (16 MiB in use) and the cap of max_num_seqs full contexts
    assert runner.num_blocks < min((32 - 16) * MiB // runner.block_bytes(), 64 * (256 // 16 + 1) + 1)
    out = llm.generate(["hello"], SamplingParams(max_tokens=2))  # the real cache was made after the profile
    assert len(out[0].outputs[0].token_ids) == 2


def test_num_kv_blocks_skips_the_profile(model_dir, accelerator, monkeypatch):
    spy = Spy(monkeypatch)
    llm = _llm(model_dir, ProfiledAccelerator.name, num_kv_blocks=40)
    assert llm.engine.runner.num_blocks == 40 and spy.forwards == []


def test_the_cpu_does_not_profile(model_dir, monkeypatch):
    """The host's RAM is shared with every process: the KV cache is --kv-cache-space, not a measurement."""
    spy = Spy(monkeypatch)
    assert CpuPlatform.peak_memory_allocated() is None
    llm = _llm(model_dir, "cpu", kv_cache_space=0.01)
    assert spy.forwards == [] and spy.logit_rows == []
    assert llm.engine.runner.num_blocks == int(0.01 * (1 << 30)) // llm.engine.runner.block_bytes()


@pytest.mark.parametrize("platform, runtime", [(cuda.CudaPlatform, torch.cuda), (xpu.XpuPlatform, torch.xpu)])
def test_torch_runtime_platforms_read_the_allocators_counters(monkeypatch, platform, runtime):
    calls = []
    monkeypatch.setattr(runtime, "reset_peak_memory_stats", lambda index: calls.append(("reset", index)))
    monkeypatch.setattr(runtime, "max_memory_allocated", lambda index: 5 * MiB + index)
    monkeypatch.setattr(runtime, "memory_reserved", lambda index: 6 * MiB)
    monkeypatch.setattr(runtime, "mem_get_info", lambda index: (50 * MiB, 64 * MiB))  # (free, total)
    platform.reset_peak_memory(1)
    assert calls == [("reset", 1)]
    assert platform.peak_memory_allocated(1) == 5 * MiB + 1
    assert platform.non_torch_memory(1) == (64 - 50 - 6) * MiB  # in use, less what torch reserved
