"""AsyncLLM with its engine in a process of its own (the default, and what `pagellm serve` runs): the same
greedy tokens as the offline LLM under concurrency, bad input refused with the engine's own error, aborts
that free KV blocks, and no orphan either way: a dead engine fails its requests, a dead front end takes
its engine with it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest
from openai_asgi import assert_engine_ended

from pagellm import LLM, AsyncLLM, SamplingParams
from pagellm.core.errors import ConfigError
from pagellm.engine.async_llm import EngineError
from pagellm.engine.process_launch import EngineLaunch
from pagellm.engine.processor import PromptTooLongError
from pagellm.server.app import build_app

PROMPTS = ["Hello, world!", "The quick brown fox", "Paged attention", "Once upon a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SETTINGS = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 128}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    llm = AsyncLLM(str(tiny_model_dir), **SETTINGS)
    assert llm.engine is None and llm._process.process.pid != os.getpid()
    yield llm
    llm.shutdown()


async def wait_idle(llm: AsyncLLM) -> None:
    for _ in range(500):
        stats = llm.latest_stats
        if (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine is not idle: {llm.latest_stats}")


def test_concurrent_streams_match_the_offline_llm(served, tiny_model_dir):
    offline = LLM(str(tiny_model_dir), **SETTINGS)
    expected = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, GREEDY, use_tqdm=False)]

    async def collect(prompt: str, kind: str) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=kind)
        outputs = [o async for o in served.generate(prompt, params)]
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        if kind == "delta":
            return [t for o in outputs for t in o.outputs[0].token_ids]
        return list(outputs[-1].outputs[0].token_ids)

    async def run():
        cumulative = await asyncio.gather(*(collect(p, "cumulative") for p in PROMPTS))
        delta = await asyncio.gather(*(collect(p, "delta") for p in PROMPTS))
        await wait_idle(served)
        return cumulative, delta

    cumulative, delta = asyncio.run(run())
    assert cumulative == expected and delta == expected
    assert served.tokenizer.decode(expected[0]) == offline.engine.tokenizer.decode(expected[0])
    assert served.max_model_len == 128 and served.kv_cache_tokens > 0


def test_bad_input_is_refused_with_the_engines_error_and_others_go_on(served):
    async def run():
        good = asyncio.create_task(collect_text(served, "Hello"))
        with pytest.raises(PromptTooLongError, match="max_model_len"):
            await served.add_request("x " * 300, GREEDY)
        with pytest.raises(ConfigError, match="out of range"):
            await served.add_request([10**9], GREEDY)
        assert await good
        await wait_idle(served)

    asyncio.run(run())
    assert served.is_running


async def collect_text(llm: AsyncLLM, prompt: str) -> str:
    return "".join(
        [
            o.outputs[0].text
            async for o in llm.generate(
                prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind="delta")
            )
        ]
    )


def test_abort_mid_stream_frees_the_blocks(served):
    async def run():
        stream = await served.add_request("Hello", SamplingParams(max_tokens=100, ignore_eos=True))
        await stream.__anext__()
        stream.abort()
        await wait_idle(served)

    asyncio.run(run())


def test_one_request_id_used_again_and_again(served):
    """As in-thread (tests/server/test_async_llm.py): an id reused as soon as its stream ended runs again."""

    async def run():
        for _ in range(40):
            outputs = [o async for o in served.generate("Hello", GREEDY, request_id="session")]
            assert outputs[-1].finished and outputs[-1].request_id == "session"
            assert len(outputs[-1].outputs[0].token_ids) == 8
        await wait_idle(served)

    asyncio.run(run())


def test_a_dead_engine_fails_its_requests_and_health_says_so(tiny_model_dir):
    llm = AsyncLLM(str(tiny_model_dir), **SETTINGS)
    app = build_app(llm, ["tiny"])

    async def run():
        stream = await llm.add_request("Hello", SamplingParams(max_tokens=120, ignore_eos=True))
        await stream.__anext__()
        llm._process.process.kill()
        with pytest.raises(EngineError, match="engine process exited"):
            [o async for o in stream]
        await assert_engine_ended(llm, app)

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()


def test_a_failed_start_raises_the_engines_error(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path / "missing")):
        AsyncLLM(str(tmp_path / "missing"), dtype="float32")


@pytest.mark.slow
def test_the_engine_exits_when_its_front_end_dies(tiny_model_dir):
    script = textwrap.dedent(
        f"""
        import os
        from pagellm import AsyncLLM
        llm = AsyncLLM({str(tiny_model_dir)!r}, dtype="float32", num_kv_blocks=64, max_model_len=128)
        print(llm._process.process.pid, flush=True)
        os._exit(0)
        """
    )
    front = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert _gone_within(int(front.stdout.split()[-1]), 10), "the engine process outlived its front end"


@pytest.mark.slow
def test_a_stopped_server_takes_its_engine_down_at_once(tiny_model_dir, tmp_path):
    """`pagellm serve` stopped by SIGTERM: its engine process, which holds the weights and the KV cache,
    ends within a couple of its polls, not after its socket's linger for turns nobody reads."""
    from server_harness import ServerProcess

    server = ServerProcess(tiny_model_dir, ["--dtype", "float32", "--num-kv-blocks", "64"], tmp_path / "log")
    engines = [pid for pid in _children(server.process.pid) if "core_process" in _cmdline(pid)]
    assert len(engines) == 1, engines
    server.stop()
    assert _gone_within(engines[0], 2.5), "the engine process outlived its server"


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_an_engine_orphaned_while_it_starts_exits_then_and_not_once_running():
    """A server stopped during its engine's start (minutes of loading and compiling) leaves no engine behind."""
    check = (
        "import threading, sys; from pagellm.engine.core_process import _exit_if_orphaned_while_starting as f; "
        "started = threading.Event(); started.set() if sys.argv[1] == 'running' else None; "
        "f(lambda: True, started)"
    )
    orphaned = subprocess.run([sys.executable, "-c", check, "starting"], timeout=60)
    running = subprocess.run([sys.executable, "-c", check, "running"], timeout=60)
    assert (orphaned.returncode, running.returncode) == (1, 0)


def test_an_engine_launched_early_is_adopted_and_gives_the_same_tokens(tiny_model_dir):
    """`pagellm serve` launches the engine process before it knows the settings (`EngineLaunch`); the
    AsyncLLM built later adopts that very process, which then serves as one started with it."""
    launched = EngineLaunch()
    llm = AsyncLLM(str(tiny_model_dir), launched=launched, **SETTINGS)
    try:
        assert llm._process.process is launched.process and launched.adopted

        async def run():
            outputs = [llm.generate(p, GREEDY, request_id=f"early-{i}") for i, p in enumerate(PROMPTS)]
            tokens = []
            for stream in outputs:
                finals = [o async for o in stream if o.finished]
                tokens.append(list(finals[-1].outputs[0].token_ids))
            return tokens

        got = asyncio.run(run())
    finally:
        llm.shutdown()
    expected = LLM(str(tiny_model_dir), **SETTINGS).generate(PROMPTS, GREEDY)
    assert got == [list(o.outputs[0].token_ids) for o in expected]


def test_an_early_launch_nobody_adopts_is_stopped(tmp_path):
    """A start that fails before adopting the launch (here: no such model), or a launch discarded, leaves no
    process behind; a child whose front end dies before sending the settings exits by itself."""
    launched = EngineLaunch()
    with pytest.raises(ConfigError):
        AsyncLLM(str(tmp_path / "missing"), dtype="float32", launched=launched)
    assert launched.process.poll() is not None

    script = "import os; from pagellm.engine.process_launch import EngineLaunch; print(EngineLaunch().process.pid, flush=True); os._exit(0)"
    front = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert _gone_within(int(front.stdout.split()[-1]), 60), "a launched engine process outlived its front end"


def test_the_serve_command_imports_no_torch_before_launching_its_engine():
    """Its engine process imports torch while the front end imports the server: nothing the command line
    loads before `EngineLaunch` may import torch itself (it took ~2 s of a warm start)."""
    check = "import sys, pagellm.cli.main, pagellm.cli.serve_cmd; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check], timeout=120).returncode == 0
