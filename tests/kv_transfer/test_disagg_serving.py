"""Disaggregated serving with every engine in a process of its own: `pagellm serve` prefill and decode engines
for each connector, behind a `pagellm proxy`. Through the proxy the answers equal one engine's token for token,
the decode engine's prefix-cache hits are the loaded blocks, a killed prefill engine or a damaged file ends in
a recompute, and no block stays held on either side."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from kvt_harness import BLOCK, DECODE, PROMPTS, prompt_of, run, storage, zmq
from server_harness import ServerProcess, free_port, metric

# two engines and the proxy take ~50 s to start; tests/kv_transfer/test_kv_connectors.py checks the transfers
# in the default run
pytestmark = pytest.mark.slow

TIMEOUT = 60
SERVE = ["--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "128"]


class Engine(ServerProcess):
    """`pagellm serve` started now and waited for later (`wait`), so the engines load side by side."""

    def _wait_healthy(self) -> None:
        pass

    def wait(self) -> Engine:
        ServerProcess._wait_healthy(self)
        return self

    def metric(self, name: str) -> float:
        return metric(httpx.get(f"{self.url}/metrics", timeout=10).text, name)


class Proxy:
    def __init__(self, prefill: Engine, decode: Engine, log_path):
        self.url = f"http://127.0.0.1:{free_port()}"
        command = [
            sys.executable,
            "-c",
            "from pagellm.cli.main import main; main()",
            "--log-level",
            "WARNING",
        ]
        command += [
            "proxy",
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--port",
            self.url.rsplit(":", 1)[1],
        ]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            assert self.process.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the proxy did not start:\n{log_path.read_text()}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=15)
        self._log.close()


@pytest.fixture(scope="module")
def stacks(model_dir, tmp_path_factory):
    """{connector: (prefill, decode, proxy)} for zmq and shared_storage."""
    logs, shared = tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("kv-files")
    configs = {
        "zmq": (zmq("kv_producer", send_timeout_s=30), zmq("kv_consumer", recv_timeout_s=2)),
        "shared_storage": (storage("kv_producer", shared), storage("kv_consumer", shared)),
    }
    engines = {
        (name, role): Engine(
            model_dir, [*SERVE, "--kv-transfer-config", json.dumps(kv)], logs / f"{name}-{role}.log"
        )
        for name, pair in configs.items()
        for role, kv in zip(("prefill", "decode"), pair, strict=True)
    }
    try:
        for engine in engines.values():
            engine.wait()
        result = {
            name: (
                engines[(name, "prefill")],
                engines[(name, "decode")],
                Proxy(engines[(name, "prefill")], engines[(name, "decode")], logs / f"{name}-proxy.log"),
            )
            for name in configs
        }
        yield result
        for _, _, proxy in result.values():
            proxy.stop()
    finally:
        for engine in engines.values():
            engine.stop()


def complete(url: str, prompt: list[int], max_tokens: int = 8, **fields) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    response = httpx.post(f"{url}/v1/completions", json={**body, **fields}, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def tokens(answer: dict) -> list[str]:
    return answer["choices"][0]["logprobs"]["tokens"]


def expected_tokens(reference, prompt: list[int], max_tokens: int = 8) -> list[str]:
    ids = run(reference, prompt, max_tokens).outputs[0].token_ids
    return [reference.tokenizer.decode([t]) for t in ids]


def assert_nothing_held(*engines: Engine) -> None:
    """Every engine's KV cache usage drops to 0 (a prefill engine frees what was read)."""
    deadline = time.monotonic() + 10
    while any(e.metric("pagellm:kv_cache_usage_perc") > 0 for e in engines):
        assert time.monotonic() < deadline, "KV blocks still held"
        time.sleep(0.1)


@pytest.mark.parametrize("connector", ["zmq", pytest.param("shared_storage", marks=pytest.mark.slow)])
def test_greedy_answers_through_the_proxy_equal_one_engines(stacks, reference, connector):
    prefill, decode, proxy = stacks[connector]
    hits = decode.metric("pagellm:prefix_cache_hits_total")
    transferred = decode.metric("pagellm:kv_transfer_loaded_tokens_total")
    prompts = PROMPTS[1:4]
    for prompt in prompts:
        assert tokens(complete(proxy.url, prompt)) == expected_tokens(reference, prompt)
    loaded = sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
    assert decode.metric("pagellm:prefix_cache_hits_total") - hits == loaded
    assert decode.metric("pagellm:kv_transfer_loaded_tokens_total") - transferred == loaded
    assert_nothing_held(prefill, decode)


def test_a_streamed_chat_through_the_proxy_equals_the_decode_engine_alone(stacks):
    prefill, decode, proxy = stacks["zmq"]
    messages = [{"role": "user", "content": "Paged attention stores keys and values in fixed-size blocks."}]
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    hits = decode.metric("pagellm:prefix_cache_hits_total")
    streamed = ""
    with httpx.stream(
        "POST", f"{proxy.url}/v1/chat/completions", json={**body, "stream": True}, timeout=TIMEOUT
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["delta"].get("content", "")
    assert decode.metric("pagellm:prefix_cache_hits_total") > hits  # it loaded the prompt's blocks
    alone = httpx.post(f"{decode.url}/v1/chat/completions", json=body, timeout=TIMEOUT).json()
    assert streamed == alone["choices"][0]["message"]["content"] != ""
    assert_nothing_held(prefill, decode)


def test_the_w2_benchmark_requests_stream_through_the_proxy(stacks):
    """`pagellm bench serve --base-url PROXY` works: the model's name, then streamed completions with usage."""
    from pagellm.bench.serve import completion_body, served_model_name

    prefill, decode, proxy = stacks["zmq"]
    hits = decode.metric("pagellm:prefix_cache_hits_total")
    body = completion_body(served_model_name(proxy.url), prompt_of(40, 30), 6)
    usage = None
    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] == 40
    assert decode.metric("pagellm:prefix_cache_hits_total") - hits == 32
    assert_nothing_held(prefill, decode)


def test_a_truncated_or_deleted_kv_file_is_recomputed(stacks, reference, tmp_path_factory):
    prefill, decode, _ = stacks["shared_storage"]
    directory = json.loads(prefill.process.args[prefill.process.args.index("--kv-transfer-config") + 1])
    root = directory["kv_connector_extra_config"]["shared_storage_path"]
    hits = decode.metric("pagellm:prefix_cache_hits_total")
    failures = decode.metric("pagellm:kv_transfer_load_failures_total")
    for damage, prompt in (("truncate", prompt_of(64, 21)), ("delete", prompt_of(64, 22))):
        before = set(_files(root))
        complete(prefill.url, prompt, 1, kv_transfer_params=DECODE)
        new = set(_files(root)) - before
        assert len(new) == 4
        for path in new:
            if damage == "truncate":
                with open(path, "r+b") as f:
                    f.truncate(100)
            else:
                path.unlink()
        assert tokens(complete(decode.url, prompt)) == expected_tokens(reference, prompt)
    assert decode.metric("pagellm:prefix_cache_hits_total") == hits  # nothing loaded: recomputed
    assert decode.metric("pagellm:kv_transfer_load_failures_total") > failures  # the truncated file
    assert_nothing_held(prefill, decode)


def test_a_killed_prefill_engine_ends_in_a_recompute(stacks, reference):
    prefill, decode, proxy = stacks["zmq"]
    prompt = prompt_of(90, 23)
    params = complete(prefill.url, prompt, 1, kv_transfer_params=DECODE)["kv_transfer_params"]
    assert params["remote_block_ids"]
    for pid in [*_children(prefill.process.pid), prefill.process.pid]:  # the engine process, then the server
        os.kill(pid, signal.SIGKILL)
    prefill.process.wait()
    hits = decode.metric("pagellm:prefix_cache_hits_total")
    started = time.monotonic()
    answer = complete(decode.url, prompt, kv_transfer_params=params)
    assert tokens(answer) == expected_tokens(reference, prompt)
    assert 2 <= time.monotonic() - started < 10  # the read timed out after recv_timeout_s, then it recomputed
    assert decode.metric("pagellm:prefix_cache_hits_total") == hits
    other = prompt_of(50, 24)  # the proxy cannot reach the prefill engine: the decode engine computes it all
    assert tokens(complete(proxy.url, other)) == expected_tokens(reference, other)
    assert_nothing_held(decode)


def _files(root: str) -> list:
    from pathlib import Path

    return list(Path(root).rglob("*.safetensors"))


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]
