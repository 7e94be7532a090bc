"""Data parallelism (`data_parallel_size=2`): two engine processes behind one `LLM` or `AsyncLLM`.

Greedy outputs equal one engine's token for token (Llama, Qwen2 and Mistral shapes, LoRA too) through
`LLM` and through the OpenAI server; requests are spread over both engines and their stats add up in
/metrics; a killed engine fails the requests with an error naming its rank, quickly, and /health says
so; bad settings and a failed start are refused at start-up without leaving processes behind."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import psutil
import pytest
import torch
from openai_asgi import assert_engine_ended, call_app
from parity import ARCHS
from tiny import make_tiny_checkpoint

import pagellm.engine.data_parallel as data_parallel
from pagellm import LLM, AsyncLLM, LoRARequest, SamplingParams
from pagellm.core.errors import ConfigError
from pagellm.engine.core import EngineError
from pagellm.engine.data_parallel import aggregate_stats, child_environment
from pagellm.engine.scheduler import SchedulerStats
from pagellm.server.app import build_app

SETTINGS = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 128}
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
TEXTS = ["Hello, world!", "The quick brown fox", "Paged attention", "Once upon a time"]


def token_prompts(seed: int = 0) -> list[dict]:
    """Eight prompts of 1 to 100 tokens: past Mistral's 48-token sliding window, across block edges."""
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]}
        for n in (1, 7, 16, 17, 33, 60, 90, 100)
    ]


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def make_adapter(base, out):
    """A random PEFT LoRA adapter for `base` whose B is not zero, so it changes the outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    peft_model.save_pretrained(out)
    return out


# -- through LLM ------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "arch", [pytest.param(a, marks=pytest.mark.slow) for a in ("llama", "qwen2", "mistral-sliding-window")]
)
def test_greedy_outputs_equal_one_engine_through_llm(arch, tmp_path):
    path = make_tiny_checkpoint(arch.split("-")[0], tmp_path, **ARCHS[arch])
    settings = dict(SETTINGS)
    lora = None
    if arch == "llama":  # adapters pass through to whichever engine runs the request
        settings.update(enable_lora=True, max_lora_rank=8)
        lora = LoRARequest("a", 1, str(make_adapter(path, tmp_path / "adapter")))
    prompts = token_prompts() + TEXTS
    loras = [lora if i % 3 == 0 else None for i in range(len(prompts))]

    one = LLM(str(path), **settings)
    expected = tokens(one.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    del one

    two = LLM(str(path), data_parallel_size=2, **settings)
    try:
        assert tokens(two.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)) == expected
        engines = two.engine.engines
        assert engines.routed == [6, 6] and engines.unfinished == [0, 0]
        if lora is not None:
            assert tokens(two.generate(prompts[:1], GREEDY, use_tqdm=False)) != expected[:1]  # it matters
            # every prompt is checked before any runs: one bad adapter fails the call with nothing queued
            missing = LoRARequest("missing", 2, str(tmp_path / "missing"))
            routed = list(engines.routed)
            with pytest.raises(ConfigError, match="missing"):
                two.generate(TEXTS, GREEDY, use_tqdm=False, lora_request=[None, None, None, missing])
            assert engines.routed == routed
        # each engine seeds its own sampler: one prompt sampled on both engines at once comes out twice different
        sampled = two.generate(
            [TEXTS[0]] * 2, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0), use_tqdm=False
        )
        assert tokens(sampled)[0] != tokens(sampled)[1]
        assert two.reset_prefix_cache()
        chat = [{"role": "user", "content": "Hi"}]
        assert two.chat([chat, chat], GREEDY, use_tqdm=False)[1].outputs[0].token_ids
    finally:
        two.shutdown()
    assert all(process.process.poll() is not None for process in engines.ranks)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("dp"))


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_killed_engine_fails_llm_generate_naming_its_rank(llama):
    llm = LLM(str(llama), data_parallel_size=2, dtype="float32", num_kv_blocks=256, max_model_len=512)
    engines = llm.engine.engines
    victim = engines.ranks[1].process

    def kill_once_both_run():
        while engines.stats().num_running < 2 and victim.poll() is None:
            time.sleep(0.005)
        os.kill(victim.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_both_run)
    try:
        killer.start()
        start = time.monotonic()
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        with pytest.raises(EngineError, match="data-parallel rank 1: the engine process exited with code -9"):
            llm.generate(TEXTS, long, use_tqdm=False)
        assert time.monotonic() - start < 10
        with pytest.raises(EngineError, match="data-parallel rank 1"):  # later calls too, at once
            llm.generate(TEXTS, long, use_tqdm=False)
        engines.ranks[0].process.wait(timeout=10)  # the other rank was shut down
    finally:
        killer.join()
        llm.shutdown()


# -- through AsyncLLM and the server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(llama):
    llm = AsyncLLM(str(llama), data_parallel_size=2, **SETTINGS)
    yield llm, build_app(llm, ["tiny"], log_requests=False)
    llm.shutdown()


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_greedy_outputs_equal_one_engine_through_the_server(served, llama):
    llm, app = served
    prompts = [p["prompt_token_ids"] for p in token_prompts(seed=1)]
    one = LLM(str(llama), **SETTINGS)
    expected = [o.outputs[0].text for o in one.generate(prompts, GREEDY, use_tqdm=False)]

    async def work(client, http):
        async def complete(prompt):
            response = await client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return response.choices[0].text

        texts = await asyncio.gather(*(complete(p) for p in prompts))
        for _ in range(200):  # the metrics count a turn before its outputs reach the client
            if llm.latest_stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        return texts, (await http.get("/metrics")).text, (await http.get("/health")).status_code

    texts, metrics, health = call_app(app, work)
    assert texts == expected and health == 200
    engines = llm._process
    assert min(engines.routed) > 0 and sum(engines.routed) == len(prompts) and engines.unfinished == [0, 0]
    # both engines' turns reach the metrics: every request and token once, the prefix-cache counts summed
    assert metric(metrics, "pagellm:request_success_total") == len(prompts)
    assert metric(metrics, "pagellm:generation_tokens_total") == len(prompts) * MAX_TOKENS
    assert metric(metrics, "pagellm:prompt_tokens_total") == sum(map(len, prompts))
    per_rank = [stats.prefix_cache_queries for stats in engines._stats]
    assert min(per_rank) > 0 and metric(metrics, "pagellm:prefix_cache_queries_total") == sum(per_rank)
    assert llm.kv_cache_tokens == engines.ranks[0].facts.kv_cache_tokens  # one request fits one engine


def test_each_engine_gets_its_share_of_the_cores(served):
    llm, _ = served
    expected = os.environ.get("OMP_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // 2))
    for process in llm._process.ranks:
        assert psutil.Process(process.process.pid).environ()["OMP_NUM_THREADS"] == expected
    assert child_environment(4, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
    assert int(child_environment(64, {})["OMP_NUM_THREADS"]) >= 1


def test_stats_add_up_and_kv_usage_is_weighted_by_capacity():
    a = SchedulerStats(2, 1, 0.5, 10, 4, 1, spec_accepted_per_position=(3, 1))
    b = SchedulerStats(1, 0, 0.0, 6, 2, 0, spec_accepted_per_position=(2,))
    total = aggregate_stats([a, b], [300, 100])
    assert (total.num_running, total.num_waiting, total.prefix_cache_queries, total.prefix_cache_hits) == (
        3,
        1,
        16,
        6,
    )
    assert total.num_preemptions == 1 and total.spec_accepted_per_position == (5, 1)
    assert total.kv_cache_usage == pytest.approx(0.375)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_killed_engine_fails_the_streams_naming_its_rank_and_health_says_so(llama):
    llm = AsyncLLM(str(llama), data_parallel_size=2, **SETTINGS)
    app = build_app(llm, ["tiny"], log_requests=False)
    long = SamplingParams(max_tokens=100, ignore_eos=True)

    async def run():
        streams = [await llm.add_request(prompt, long) for prompt in TEXTS[:2]]  # one on each engine
        assert llm._process.unfinished == [1, 1]
        for stream in streams:
            await stream.__anext__()
        llm._process.ranks[1].process.kill()
        start = time.monotonic()
        with pytest.raises(EngineError, match="data-parallel rank 1: the engine process exited with code -9"):
            [o async for o in streams[1]]
        assert time.monotonic() - start < 2
        try:  # rank 0's request ends too: finished already, or failed with the same error
            assert [o async for o in streams[0]][-1].finished
        except EngineError as exc:
            assert "data-parallel rank 1" in str(exc)
        await assert_engine_ended(llm, app)

    try:
        asyncio.run(run())
        llm._process.ranks[0].process.wait(timeout=10)  # the other engine was shut down
    finally:
        llm.shutdown()


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_engine_copies_as_ray_actors_answer_like_one_engine(llama):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'pagellm[ray]')")
    one = tokens(LLM(str(llama), **SETTINGS).generate(token_prompts(), GREEDY, use_tqdm=False))
    llm = LLM(str(llama), data_parallel_size=2, distributed_executor_backend="ray", **SETTINGS)
    try:
        assert type(llm.engine.engines.ranks[1].process).__name__ == "RayEngineHandle"
        assert tokens(llm.generate(token_prompts(), GREEDY, use_tqdm=False)) == one
        assert all(llm.engine.engines.routed)  # both copies served requests
    finally:
        llm.shutdown()
        ray.shutdown()


# -- start-up ---------------------------------------------------------------------------------------------


def test_bad_settings_are_refused_before_any_process_starts(llama):
    with pytest.raises(ConfigError, match="data_parallel_size must be a whole number >= 1"):
        LLM(str(llama), data_parallel_size=0)
    with pytest.raises(ConfigError, match="data_parallel_size must be a whole number >= 1"):
        AsyncLLM(str(llama), data_parallel_size=-1)
    with pytest.raises(ConfigError, match="engine_process=False"):
        AsyncLLM(str(llama), data_parallel_size=2, engine_process=False)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failed_start_raises_its_error_and_stops_the_other_engines(llama, tmp_path, monkeypatch):
    started, engine_process = [], data_parallel.EngineProcess

    def rank_1_fails(config, *args, **kwargs):  # rank 1 gets a model that is not there
        if started:
            config = config.replace(model=str(tmp_path / "missing"))
        started.append(engine_process(config, *args, **kwargs))
        return started[-1]

    monkeypatch.setattr(data_parallel, "EngineProcess", rank_1_fails)
    with pytest.raises(ConfigError, match=str(tmp_path / "missing")):
        AsyncLLM(str(llama), data_parallel_size=2, **SETTINGS)
    assert len(started) == 2 and all(process.process.poll() is not None for process in started)
