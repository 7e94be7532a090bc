"""Several models in one server (`pagellm serve --model A --model B`, pagellm/server/router/).

The registry's rules (a request waits for a loading model, max-loaded-models unloads the least recently used
idle model, keep-alive, failed starts) run first against fake children, in milliseconds; then one real router
serves two tiny checkpoints as child processes: both answer, an idle one is unloaded and its process and
memory are gone, and it loads again on its next request."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
import httpx
import pytest
from click.testing import CliRunner
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client.parser import text_string_to_metric_families
from server_harness import free_port
from tiny import make_tiny_checkpoint

from pagellm.cli.main import cli
from pagellm.cli.router_cmd import child_serve_args, model_specs
from pagellm.server.router.app import build_router_app
from pagellm.server.router.children import ChildStartError, ModelSpec
from pagellm.server.router.prometheus import add_label, merge_metrics
from pagellm.server.router.registry import ModelRegistry

# -- the registry, with fake children ------------------------------------------------------------------------


class FakeChild:
    def __init__(self, name: str):
        self.url, self.pid, self.running = f"http://fake/{name}", 0, True

    def alive(self) -> bool:
        return self.running

    async def stop(self) -> None:
        await asyncio.sleep(0.01)
        self.running = False


class FakeLauncher:
    """Starts take `delay` seconds; names in `failing` fail to start."""

    def __init__(self, delay: float = 0.05, failing: tuple[str, ...] = ()):
        self.delay, self.failing = delay, set(failing)
        self.started: list[str] = []
        self.children: dict[str, FakeChild] = {}

    async def start(self, model: ModelSpec) -> FakeChild:
        self.started.append(model.name)
        await asyncio.sleep(self.delay)
        if model.name in self.failing:
            raise ChildStartError(f"the server of model {model.name!r} exited with status 1 while starting")
        self.children[model.name] = FakeChild(model.name)
        return self.children[model.name]


def registry(names: str, **kwargs) -> tuple[ModelRegistry, FakeLauncher]:
    launcher = FakeLauncher(**{k: kwargs.pop(k) for k in ("delay", "failing") if k in kwargs})
    return ModelRegistry([ModelSpec(n, f"/models/{n}") for n in names], launcher, **kwargs), launcher


def states(reg: ModelRegistry) -> dict[str, str]:
    return {m["id"]: m["state"] for m in reg.describe()}


def test_requests_to_a_loading_model_wait_for_the_one_load():
    async def scenario():
        reg, launcher = registry("ab", delay=0.2)
        waiting = [asyncio.create_task(reg.acquire("a")) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert states(reg) == {"a": "loading", "b": "unloaded"}
        children = await asyncio.gather(*waiting)
        assert launcher.started == ["a"] and len({id(c) for c in children}) == 1
        assert states(reg)["a"] == "loaded" and reg.slots["a"].active == 3

    asyncio.run(scenario())


def test_max_loaded_models_unloads_the_least_recently_used_idle_model():
    async def scenario():
        reg, launcher = registry("abc", max_loaded=2)
        for name in "ab":
            await reg.acquire(name)
            reg.release(name)
        await asyncio.sleep(0.01)
        await reg.acquire("a")  # a is now the most recently used
        reg.release("a")
        await reg.acquire("c")
        assert states(reg) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert not launcher.children["b"].alive()

    asyncio.run(scenario())


def test_a_busy_model_is_not_unloaded_for_room_the_load_waits_for_it():
    async def scenario():
        reg, _ = registry("ab", max_loaded=1)
        await reg.acquire("a")  # in flight
        load_b = asyncio.create_task(reg.acquire("b"))
        await asyncio.sleep(0.1)
        assert states(reg) == {"a": "loaded", "b": "loading"}
        reg.release("a")
        await asyncio.wait_for(load_b, 2)
        assert states(reg) == {"a": "unloaded", "b": "loaded"}

    asyncio.run(scenario())


def test_keep_alive_unloads_an_idle_model_and_it_loads_again_on_demand():
    async def scenario():
        reg, launcher = registry("ab", keep_alive_s=0.2)
        await reg.acquire("a")
        reg.release("a")
        await reg.reap()
        assert states(reg)["a"] == "loaded"
        await asyncio.sleep(0.25)
        await reg.reap()
        assert states(reg)["a"] == "unloaded" and not launcher.children["a"].alive()
        await reg.acquire("a")
        assert states(reg)["a"] == "loaded" and launcher.started == ["a", "a"]

    asyncio.run(scenario())


def test_a_failed_start_is_reported_and_retried_and_frees_its_slot():
    async def scenario():
        reg, launcher = registry("ab", failing=("a",), max_loaded=1)
        with pytest.raises(ChildStartError, match="exited with status 1"):
            await reg.acquire("a")
        described = {m["id"]: m for m in reg.describe()}
        assert described["a"]["state"] == "unloaded" and "exited" in described["a"]["error"]
        await reg.acquire("b")  # the failed load gave its slot back
        launcher.failing.clear()
        reg.release("b")
        await reg.acquire("a")
        assert states(reg) == {"a": "loaded", "b": "unloaded"}

    asyncio.run(scenario())


# -- the app's own answers, with fake children ---------------------------------------------------------------


def test_router_app_errors_states_and_load_endpoints():
    async def scenario():
        reg, _ = registry("ab", failing=("b",))
        app = build_router_app(reg, max_body_bytes=1000)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://router"
        ) as client:
            listed = (await client.get("/v1/models")).json()["data"]
            assert [(m["id"], m["state"]) for m in listed] == [("a", "unloaded"), ("b", "unloaded")]
            unknown = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            assert unknown.status_code == 404
            assert (
                unknown.json()["error"]["param"] == "model" and "nope" in unknown.json()["error"]["message"]
            )
            ollama = await client.post("/api/chat", json={"model": "nope", "messages": []})
            assert ollama.status_code == 404 and "nope" in ollama.json()["error"]
            huge = await client.post("/v1/completions", json={"model": "a", "prompt": "x" * 2000})
            assert huge.status_code == 413 and "--max-request-body-mb" in huge.json()["error"]["message"]
            missing = await client.post("/v1/chat/completions", json={"messages": []})
            assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
            loaded = await client.post("/models/load", json={"model": "a"})
            assert loaded.status_code == 200 and loaded.json()["state"] == "loaded"
            failed = await client.post("/models/load", json={"model": "b"})
            assert failed.status_code == 503 and failed.json()["error"]["param"] == "model"
            assert "could not be loaded" in failed.json()["error"]["message"]
            assert (await client.get("/health")).status_code == 200  # the router lives on
            tags = (await client.get("/api/tags")).json()["models"]
            assert [m["name"] for m in tags] == ["a", "b"]
            assert (await client.post("/models/unload", json={"model": "a"})).json()["state"] == "unloaded"
            metrics = (await client.get("/metrics")).text
            assert 'pagellm:router_model_loads_total{model="a"} 1' in metrics

    asyncio.run(scenario())


def test_router_api_keys():
    async def scenario():
        reg, _ = registry("ab")
        app = build_router_app(reg, api_keys=["k1"])
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://router"
        ) as client:
            assert (await client.get("/v1/models")).status_code == 401
            assert (await client.get("/v1/models", headers={"Authorization": "Bearer k1"})).status_code == 200
            assert (await client.get("/health")).status_code == 200

    asyncio.run(scenario())


def test_children_metrics_are_merged_with_a_model_label():
    child = '# HELP pagellm:x X.\n# TYPE pagellm:x gauge\npagellm:x{model_name="m"} 1.0\nup 1\n'
    merged = merge_metrics([("a", child), ("b", child.replace("1.0", "2.0"))])
    assert merged.count("# TYPE pagellm:x gauge") == 1
    assert (
        'pagellm:x{model="a",model_name="m"} 1.0' in merged
        and 'pagellm:x{model="b",model_name="m"} 2.0' in merged
    )
    assert merged.index('model="b",model_name') < merged.index('up{model="a"}')  # a family stays together
    assert add_label("m{} 1", "model", 'q"') == 'm{model="q\\""} 1'


class ThreadServer:
    """An ASGI app served by uvicorn on a free localhost port, in a thread."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def streaming_model_server() -> tuple[FastAPI, list[str]]:
    """A stand-in model server: a completion stream of 100 events, 20 ms apart; `events` records how it
    ended ("finished", or "cancelled" when its client went away)."""
    app, events = FastAPI(), []

    @app.post("/v1/completions")
    async def completions(raw: Request) -> StreamingResponse:
        body = await raw.json()

        async def stream():
            try:
                for i in range(100):
                    yield f'data: {{"model": "{body["model"]}", "i": {i}}}\n\n'
                    await asyncio.sleep(0.02)
                events.append("finished")
            except asyncio.CancelledError:
                events.append("cancelled")
                raise

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app, events


def test_streams_pass_through_and_a_client_leaving_mid_stream_frees_the_model():
    app, events = streaming_model_server()
    model_server = ThreadServer(app)

    class Launcher:
        async def start(self, model: ModelSpec) -> FakeChild:
            child = FakeChild(model.name)
            child.url = model_server.url
            return child

    reg = ModelRegistry([ModelSpec("a", "/m/a"), ModelSpec("b", "/m/b")], Launcher())
    router = ThreadServer(build_router_app(reg))
    try:
        body = {"model": "a", "prompt": "x", "stream": True}
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=10) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith(
                "text/event-stream"
            )
            lines = [line for line in response.iter_lines() if line]
        assert len(lines) == 100 and lines[0] == 'data: {"model": "a", "i": 0}'
        assert reg.slots["a"].active == 0 and events == ["finished"]
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=10) as response:
            # Hold the line iterator: a discarded one is closed at once, and closing it closes the connection,
            # which would race the router into freeing the model before the check below.
            stream_lines = response.iter_lines()
            next(stream_lines)
            assert reg.slots["a"].active == 1
        deadline = time.monotonic() + 5  # the client left after one event
        while (reg.slots["a"].active, events) != (0, ["finished", "cancelled"]):
            assert time.monotonic() < deadline, (reg.slots["a"].active, events)
            time.sleep(0.05)
    finally:
        router.stop()
        model_server.stop()


# -- the command line ----------------------------------------------------------------------------------------


def test_models_are_found_and_named(tmp_path):
    (tmp_path / "llama-a").mkdir()
    (tmp_path / "llama-a" / "config.json").write_text("{}")
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "small.Q4_K_M.gguf").write_bytes(b"GGUF")
    specs = model_specs(None, ("x=/m/x", "Org/Name"), str(tmp_path))
    assert [(s.name, s.path) for s in specs] == [
        ("x", "/m/x"),
        ("Org/Name", "Org/Name"),
        ("llama-a", str(tmp_path / "llama-a")),
        ("small.Q4_K_M", str(tmp_path / "small.Q4_K_M.gguf")),
    ]
    (embedded,) = model_specs(None, (), None)  # `pagellm serve --keep-alive S`: the embedded model
    assert embedded == ModelSpec("SmolLM2-135M-Instruct", "")
    with pytest.raises(click.UsageError, match="several models are named x"):
        model_specs(None, ("x=/a", "x=/b"), None)


def test_router_serves_the_chat_page_without_a_key_unless_told_not_to():
    """The page lists every model from the router's /v1/models: it is the router's, not a child's."""

    async def scenario(web_ui: bool) -> tuple[int, str, int]:
        reg, _ = registry("ab")
        app = build_router_app(reg, api_keys=["k1"], web_ui=web_ui)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://router"
        ) as client:
            page = await client.get("/")
            api = await client.get("/v1/models")
            return page.status_code, page.headers.get("content-security-policy", ""), api.status_code

    status, policy, api = asyncio.run(scenario(web_ui=True))
    assert status == 200 and "default-src 'self'" in policy and api == 401
    assert asyncio.run(scenario(web_ui=False))[0] in (401, 404, 405)


def test_children_inherit_the_serve_options_but_not_the_routers(monkeypatch):
    seen = {}

    def fake_router(ctx, model_arg, models, routed):
        seen.update(args=child_serve_args(ctx), models=models, routed=routed)

    monkeypatch.setattr("pagellm.cli.serve_cmd.serve_router", fake_router)
    argv = ["serve", "--model", "a=/m/a", "--model", "b=/m/b", "--port", "9", "--max-loaded-models", "1"]
    argv += [
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--enable-prefix-caching",
        "--lora-modules",
        "l=/p",
        "--no-web-ui",
    ]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    assert seen["models"] == ("a=/m/a", "b=/m/b") and seen["routed"]["max_loaded_models"] == 1
    args = seen["args"]
    assert "--port" not in args and "--model" not in args and "--max-loaded-models" not in args
    for flag, value in (("--dtype", "float32"), ("--max-model-len", "128"), ("--lora-modules", "l=/p")):
        assert args[args.index(flag) + 1] == value
    assert "--enable-prefix-caching" in args
    assert "--no-web-ui" not in args  # the page is the router's


# -- a real router with two tiny models ---------------------------------------------------------------------


def parent_pids() -> dict[int, int]:
    """Every process's parent, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    return parents


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and all of its descendants, from /proc."""
    parents = parent_pids()
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += [p for p, parent in parents.items() if parent == current]
    total = 0
    for p in tree:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def two_models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("router")
    return make_tiny_checkpoint("llama", root / "a"), make_tiny_checkpoint("llama", root / "b")


class Router:
    """`pagellm serve --model a=A --model b=B ARGS...` in a subprocess (its /health answers at once)."""

    def __init__(self, models: tuple[Path, Path], args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "pagellm.cli",
            "--log-level",
            "INFO",
            "serve",
            "--port",
            str(self.port),
        ]
        command += ["--model", f"a={models[0]}", "--model", f"b={models[1]}", *args]
        command += ["--dtype", "float32", "--max-model-len", "128", "--num-kv-blocks", "32"]
        self.log_path, self._log = log_path, open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, log_path.read_text()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError(f"the router did not answer /health:\n{log_path.read_text()}")

    def states(self) -> dict[str, str]:
        return {m["id"]: m["state"] for m in httpx.get(self.url + "/v1/models").json()["data"]}

    def complete(self, model: str, results: list | None = None) -> httpx.Response:
        body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        response = httpx.post(self.url + "/v1/completions", json=body, timeout=300)
        if results is not None:
            results.append(response)
        return response

    def child_pids(self) -> list[int]:
        return [p for p, parent in parent_pids().items() if parent == self.process.pid and pid_alive(p)]

    def wait_for(self, expected: dict[str, str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.states() != expected:
            assert time.monotonic() < deadline, (self.states(), self.log_path.read_text()[-3000:])
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def test_two_models_load_on_demand_and_unload_when_idle_giving_their_memory_back(two_models, tmp_path):
    router = Router(two_models, ["--keep-alive", "6"], tmp_path / "router.log")
    try:
        assert router.states() == {"a": "unloaded", "b": "unloaded"}
        unknown = httpx.post(router.url + "/v1/completions", json={"model": "c", "prompt": "x"})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
        baseline = tree_rss_bytes(router.process.pid)
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=router.complete, args=(m, results)) for m in "aab"]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        assert router.states() == {"a": "loading", "b": "loading"}  # the requests wait, none fails
        for thread in threads:
            thread.join(300)
        assert sorted((r.status_code, r.json()["model"]) for r in results) == [
            (200, "a"),
            (200, "a"),
            (200, "b"),
        ]
        pids = router.child_pids()
        assert len(pids) == 2
        loaded_rss = tree_rss_bytes(router.process.pid)
        metrics = httpx.get(router.url + "/metrics").text
        assert 'pagellm:router_requests_total{model="a"} 2' in metrics
        assert any(f'{{model="{m}",model_name="{m}"}}' in metrics for m in "ab")  # a child's own, labelled
        families = list(text_string_to_metric_families(metrics))  # valid Prometheus text, each family once
        assert len({f.name for f in families}) == len(families)

        router.wait_for({"a": "unloaded", "b": "unloaded"}, timeout=60)  # --keep-alive 6
        deadline = time.monotonic() + 30  # "unloaded" at once; the processes finish exiting just after
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(pid_alive(p) for p in pids) and router.child_pids() == []
        after = tree_rss_bytes(router.process.pid)
        assert loaded_rss > baseline + 300 * 2**20  # two models did take memory ...
        assert after < baseline + 100 * 2**20, (baseline, loaded_rss, after)  # ... and gave it back
    finally:
        router.stop()


@pytest.mark.slow
def test_max_loaded_models_unloads_the_lru_child_process(two_models, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    args = ["--max-loaded-models", "1", "--model", f"broken={broken}"]
    router = Router(two_models, args, tmp_path / "router.log")
    try:
        failed = router.complete("broken")  # its server exits while starting: 503, and the router goes on
        assert failed.status_code == 503 and failed.json()["error"]["param"] == "model", failed.text
        assert "exited with status" in failed.json()["error"]["message"]
        assert router.states()["broken"] == "unloaded"
        assert router.complete("a").status_code == 200
        (pid_a,) = router.child_pids()
        assert router.complete("b").status_code == 200
        assert router.states() == {"a": "unloaded", "b": "loaded", "broken": "unloaded"}
        assert not pid_alive(pid_a) and len(router.child_pids()) == 1
        streamed = httpx.post(
            router.url + "/v1/chat/completions",
            json={
                "model": "a",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "stream": True,
            },
            timeout=300,
        )
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        assert router.states() == {"a": "loaded", "b": "unloaded", "broken": "unloaded"}  # a again, on demand
        pids = router.child_pids()
    finally:
        router.stop()
    assert not any(pid_alive(p) for p in pids)  # stopping the router stops its models
