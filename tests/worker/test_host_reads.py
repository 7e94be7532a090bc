"""Host syncs and host copies per step: a step reads device tensors to the host a fixed number of times
(not once per token or per logprob), and host arrays reach an accelerator through page-locked memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.core import transfer
from pagellm.worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("reads"))
    return LLM(str(path), device="cpu", dtype="float32", attention_backend="TORCH_SDPA", num_kv_blocks=60)


READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@pytest.fixture
def count_reads(monkeypatch):
    """Count every read of a tensor's values by the host (each one waits for the device) during
    `ModelRunner.execute`."""
    counts = {"reads": 0, "active": False}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counts["reads"] += counts["active"]
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    execute = ModelRunner.execute

    def counting_execute(self, out):
        counts["active"] = True
        try:
            return execute(self, out)
        finally:
            counts["active"] = False

    monkeypatch.setattr(ModelRunner, "execute", counting_execute)
    return counts


def _one_step(llm: LLM, prompt_len: int, count_reads) -> int:
    """Host reads in the one step that runs a prompt with prompt logprobs and samples with logprobs."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3, prompt_logprobs=2)
    count_reads["reads"] = 0
    out = llm.generate({"prompt_token_ids": list(range(3, 3 + prompt_len))}, params, use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == prompt_len and len(out.outputs[0].logprobs[0]) >= 3
    return count_reads["reads"]


def test_a_step_reads_to_the_host_a_fixed_number_of_times(llm, count_reads):
    short, long = _one_step(llm, 8, count_reads), _one_step(llm, 90, count_reads)
    assert short == long  # not one read per prompt token or per logprob
    assert long <= 16


def test_prompt_logprobs_of_requests_batched_together_equal_each_alone(llm):
    prompts = [list(range(5, 25)), list(range(40, 47))]
    params = [SamplingParams(max_tokens=1, prompt_logprobs=k) for k in (1, 4)]
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        alone = llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0]
        assert out.prompt_logprobs[0] is None
        for ours, theirs in zip(out.prompt_logprobs[1:], alone.prompt_logprobs[1:], strict=True):
            assert ours.keys() == theirs.keys() and len(ours) >= p.prompt_logprobs
            for token, entry in ours.items():
                assert entry.rank == theirs[token].rank
                assert entry.logprob == pytest.approx(theirs[token].logprob, abs=1e-5)


@pytest.fixture
def recorded(monkeypatch):
    """Pretend "cuda" is this process's accelerator and record pin_memory and to/copy_ calls."""
    calls = []
    monkeypatch.setattr(transfer, "pins_memory", lambda device_type: device_type == "cuda")

    def pin_memory(self):
        calls.append(("pin",))
        pinned = self.clone()
        pinned.is_pinned_ = True
        return pinned

    def to(self, device, non_blocking=False):
        calls.append(("to", str(device), non_blocking, getattr(self, "is_pinned_", False)))
        return self

    def copy_(self, src, non_blocking=False):
        calls.append(("copy_", non_blocking, getattr(src, "is_pinned_", False)))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return calls


def test_host_arrays_reach_an_accelerator_through_page_locked_memory(recorded):
    runner = type("Runner", (), {"device": torch.device("cuda", 0)})()
    array = np.arange(6, dtype=np.int64)
    ModelRunner._dev(runner, array)
    assert recorded == [("pin",), ("to", "cuda:0", True, True)]  # non_blocking only from pinned memory
    recorded.clear()
    transfer.copy_to(torch.zeros(6, dtype=torch.long), torch.from_numpy(array))  # a CPU destination
    assert recorded == [("copy_", False, False)]
    recorded.clear()
    transfer.to_device(torch.from_numpy(array), torch.device("xla"))  # no page-locked memory there
    assert recorded == [("to", "xla", False, False)]


def test_the_cpu_keeps_the_array_itself():
    array = np.arange(4, dtype=np.int64)
    assert ModelRunner._dev(type("Runner", (), {"device": torch.device("cpu")})(), array).data_ptr() == (
        array.ctypes.data
    )
    assert not transfer.pins_memory("cpu")
