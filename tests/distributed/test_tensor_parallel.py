"""Tensor and pipeline parallelism on 2 (and 4) gloo ranks on this CPU: greedy tokens equal transformers'
(float32, through chunked prefill and preemption) on Llama, Qwen2 and Mistral shapes, through `LLM` and
through the server; a rank that dies or hangs ends the engine with a RankFailure within the timeout; a
split the model cannot take is refused before anything loads."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest
from parity import Reference, assert_greedy_parity, mixed_prompts, tiny_model_and_reference

from pagellm import LLM, AsyncLLM, SamplingParams
from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.distributed import RankFailure
from pagellm.engine.async_llm import EngineError
from pagellm.engine.setup import resolve_engine
from pagellm.server.app import build_app

MAX_TOKENS = 12
# chunked prefill (64-token steps) and a cache small enough that the long prompts preempt each other
SETTINGS = dict(
    dtype="float32", enforce_eager=True, max_num_batched_tokens=64, max_num_seqs=16, num_kv_blocks=40
)


class _Models(dict):
    """Tiny checkpoints and their oracles, each built on first use (most runs need only Llama's)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, arch):
        self[arch] = tiny_model_and_reference(arch, self.root, MAX_TOKENS)
        return self[arch]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _Models(tmp_path_factory.mktemp("parallel"))


@contextlib.contextmanager
def split_llm(path, **settings):
    """An LLM over several ranks, shut down afterwards (one such engine per process)."""
    llm = LLM(str(path), **{**SETTINGS, **settings})
    try:
        yield llm
    finally:
        llm.shutdown()


def prompts(vocab: int) -> list[list[int]]:
    return mixed_prompts(vocab)[::2]  # 9 prompts of 1 to 256 tokens


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        *(
            pytest.param(a, marks=pytest.mark.slow)
            for a in ("qwen2", "mistral-sliding-window", "qwen3-mixed-windows")
        ),
    ],
)
@pytest.mark.parametrize("tp,pp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)], ids=["tp2", "pp2"])
def test_greedy_parity_with_transformers(models, arch, tp, pp):
    path, reference = models[arch]
    # a sliding window frees the blocks behind it (KV cache groups): Mistral preempts only with fewer blocks
    blocks = 10 if arch == "mistral-sliding-window" else 40
    with split_llm(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_kv_blocks=blocks) as llm:
        assert llm.engine.ranks is not None and len(llm.engine.ranks.processes) == tp * pp - 1
        assert_greedy_parity(llm, reference, prompts(llm.engine.setup.hf_config.vocab_size))
        assert llm.engine.stats().num_preemptions > 0  # the small cache really preempted


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_engine_nobody_references_stops_its_ranks_so_another_can_start(models):
    """No shutdown(): the first engine's finalizer stops its rank processes when it is let go."""
    from pagellm import LLM, SamplingParams

    path, _ = models["llama"]
    params = SamplingParams(temperature=0, max_tokens=2)

    def first() -> list:
        llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=16, max_model_len=64)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        return list(llm.engine.ranks.processes.values())

    processes = first()
    second = LLM(str(path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=16, max_model_len=64)
    try:
        assert all(p.poll() is not None for p in processes)  # the first engine's ranks ended
        assert (
            second.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids
        )
    finally:
        second.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_tensor_and_pipeline_together_on_four_ranks(models):
    path, reference = models["qwen2"]
    with split_llm(path, tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        assert_greedy_parity(llm, reference, prompts(llm.engine.setup.hf_config.vocab_size)[:5])


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_server_answers_from_two_ranks(models):
    from openai_asgi import call_app

    path, reference = models["llama"]
    llm = AsyncLLM(str(path), tensor_parallel_size=2, **SETTINGS)
    app = build_app(llm, ["tiny"], log_requests=False)
    prompt_ids = prompts(reference.model.config.vocab_size)[:4]

    async def work(client, http):
        out = []
        for ids in prompt_ids:
            reply = await client.completions.create(
                model="tiny", prompt=ids, max_tokens=MAX_TOKENS, temperature=0
            )
            out.append(reply.choices[0].text)
        return out

    try:
        texts = call_app(app, work)
    finally:
        llm.shutdown()
    one_process = LLM(str(path), **SETTINGS).generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
    )
    assert texts == [o.outputs[0].text for o in one_process]


def long_run(llm: LLM):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, params, use_tqdm=False)


@pytest.mark.timeout(120)
def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(models):
    path, _ = models["llama"]
    with split_llm(path, tensor_parallel_size=2, distributed_timeout=20) as llm:
        threading.Timer(1.0, llm.engine.ranks.processes[1].kill).start()
        started = time.monotonic()
        with pytest.raises(RankFailure, match=r"rank 1 \(exit code -9\)"):
            long_run(llm)
        assert time.monotonic() - started < 20  # the broken connection shows at once, not at the timeout
        with pytest.raises(RankFailure):  # for good: the engine does not run half a model
            llm.generate("again", use_tqdm=False)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_hung_rank_fails_the_engine_within_the_timeout(models):
    path, _ = models["llama"]
    with split_llm(path, pipeline_parallel_size=2, distributed_timeout=3) as llm:
        rank1 = llm.engine.ranks.processes[1]
        os.kill(rank1.pid, signal.SIGSTOP)
        started = time.monotonic()
        try:
            with pytest.raises(RankFailure, match="did not answer within 3s"):
                long_run(llm)
            assert time.monotonic() - started < 15
        finally:
            rank1.kill()


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_dead_rank_fails_the_async_engines_requests_with_its_name(models):
    import asyncio

    path, _ = models["llama"]
    llm = AsyncLLM(str(path), engine_process=False, tensor_parallel_size=2, **SETTINGS)

    async def run():
        stream = await llm.add_request(
            "Hello", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        )
        llm.engine.ranks.processes[1].kill()
        with pytest.raises(EngineError, match="rank 1"):
            async for _ in stream:
                pass

    try:
        asyncio.run(run())
        deadline = time.monotonic() + 10
        while llm.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.is_running  # so /health says 503
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "arch,settings,message",
    [
        ("llama", {"tensor_parallel_size": 3}, "4 attention heads do not divide by it"),
        ("llama", {"tensor_parallel_size": 4, "num_key_value_heads": 3}, "3 KV heads"),
        ("llama", {"pipeline_parallel_size": 3}, "more than the model's 2 layers"),
        ("llama", {"tensor_parallel_size": 0}, "at least 1"),
        ("llama", {"tensor_parallel_size": 2, "enable_lora": True}, "LoRA"),
        ("llama", {"tensor_parallel_size": 2, "quantization": "int8"}, "quantization"),
        (
            "gpt2",
            {"tensor_parallel_size": 2},
            r"does not support tensor or pipeline parallelism yet \(GPT-2's blocks",
        ),
    ],
)
def test_splits_the_model_cannot_take_are_refused_before_loading(tmp_path, arch, settings, message):
    from tiny import make_tiny_checkpoint

    settings = dict(settings)
    overrides = (
        {"num_key_value_heads": settings.pop("num_key_value_heads")}
        if "num_key_value_heads" in settings
        else {}
    )
    if overrides:
        overrides["num_attention_heads"] = 12
        overrides["hidden_size"] = 96
    path = make_tiny_checkpoint(arch, tmp_path, **overrides)
    with pytest.raises(ConfigError, match=message):
        resolve_engine(EngineConfig(model=str(path), attention_backend="TORCH_SDPA", **settings))


def test_reference_helper_is_deterministic(models):  # guards the oracle the tests above lean on
    path, reference = models["llama"]
    again = Reference(path, MAX_TOKENS)
    prompt = prompts(reference.model.config.vocab_size)[3]
    assert again.generate(prompt) == reference.generate(prompt)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_tensor_parallel_under_the_ray_executor_on_a_local_cluster(models):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'pagellm[ray]')")
    path, reference = models["qwen2"]
    try:
        with split_llm(path, tensor_parallel_size=2, distributed_executor_backend="ray") as llm:
            assert type(llm.engine.ranks).__name__ == "RayRanks"
            assert_greedy_parity(llm, reference, prompts(llm.engine.setup.hf_config.vocab_size)[:5])
    finally:
        ray.shutdown()


def test_every_family_that_cannot_split_names_the_layers_that_cannot():
    """A refusal says which layers keep the family whole (the hybrids' recurrent mixers, a vision tower,
    GPT-2's and OPT's own blocks), not just that it is refused."""
    from pagellm.models.base import CausalLM
    from pagellm.models.loader import import_model_class
    from pagellm.models.registry import pagellm_models

    whole = {import_model_class(path) for path in pagellm_models().values()}
    whole = {cls for cls in whole if not cls.supports_parallel}
    assert whole, "some families run on one rank only"
    for cls in whole:
        assert cls.unsplit_layers != CausalLM.unsplit_layers, f"{cls.__name__} does not say which layers"
