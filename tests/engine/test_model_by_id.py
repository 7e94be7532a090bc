"""Models given by Hugging Face id (ORG/NAME) resolve in a Hugging Face cache on disk, laid out as
huggingface_hub writes it (tests/models/hf_cache.py), with HF_HUB_OFFLINE=1: what huggingface_hub's own API
finds is what pagellm loads. The online path (no network here) is covered with huggingface_hub's listing and
download calls replaced: which files it asks for, under one lock, and the fallback when the Hub is down."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from pathlib import Path

import huggingface_hub
import pytest
from click.testing import CliRunner
from hf_cache import put_in_hf_cache
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.engine.setup import resolve_model_source, resolve_tokenizer
from pagellm.models import hub as hub_module
from pagellm.models.hub import ModelId, model_snapshot, parse_model_id

ENGINE = dict(dtype="float32", num_kv_blocks=64, max_model_len=128, attention_backend="TORCH_SDPA")
PROMPTS = ["Hello, world", "The quick brown"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def local_tokens(tiny_dir) -> list[list[int]]:
    return _tokens(LLM(str(tiny_dir), **ENGINE))


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache as HF_HUB_CACHE, offline; the working directory holds no org/ folder."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return cache


def _source(model: str, **settings) -> str:
    source = resolve_model_source(EngineConfig(model=model, **settings))
    return source.gguf_original or source.directory


def test_model_ids_are_parsed_in_vllms_spellings():
    assert parse_model_id("Qwen/Qwen3-0.6B") == ModelId("Qwen/Qwen3-0.6B")
    assert parse_model_id("org/name-GGUF:name.Q8_0.gguf") == ModelId("org/name-GGUF", "name.Q8_0.gguf")
    assert parse_model_id("unsloth/Qwen3-0.6B-GGUF:Q4_K_M") == ModelId("unsloth/Qwen3-0.6B-GGUF", "Q4_K_M")
    assert parse_model_id("org/name/file.gguf") == ModelId("org/name", "file.gguf")
    for not_an_id in (
        "gpt2",
        "./org/name",
        "/models/org/name",
        "~/org/name",
        "a/b/c",
        "org/name:",
        "org/name/x",
    ):
        assert parse_model_id(not_an_id) is None, not_an_id


def test_an_id_in_the_cache_generates_what_its_directory_does(hf_cache, tiny_dir, local_tokens):
    snapshot = put_in_hf_cache(hf_cache, "org/tiny", tiny_dir)
    llm = LLM("org/tiny", **ENGINE)
    assert llm.engine.setup.source.directory == str(snapshot)
    assert _tokens(llm) == local_tokens
    # huggingface_hub's own reading of the cache agrees with the snapshot pagellm loaded
    (repo,) = huggingface_hub.scan_cache_dir(hf_cache).repos
    assert repo.repo_id == "org/tiny" and [str(r.snapshot_path) for r in repo.revisions] == [str(snapshot)]
    assert huggingface_hub.try_to_load_from_cache("org/tiny", "config.json", cache_dir=hf_cache) == str(
        snapshot / "config.json"
    )
    assert huggingface_hub.snapshot_download("org/tiny", cache_dir=hf_cache, local_files_only=True) == str(
        snapshot
    )


def test_a_revision_is_a_branch_or_a_commit(hf_cache, tiny_dir, tmp_path):
    other = make_tiny_checkpoint("llama", tmp_path / "other", seed=1)
    main = put_in_hf_cache(hf_cache, "org/tiny", tiny_dir, commit="a" * 40, refs=("main",))
    dev = put_in_hf_cache(hf_cache, "org/tiny", other, commit="b" * 40, refs=("dev",))
    for revision, expected in ((None, main), ("main", main), ("dev", dev), ("b" * 40, dev), ("a" * 40, main)):
        assert _source("org/tiny", revision=revision) == str(expected), revision
        found = huggingface_hub.snapshot_download(
            "org/tiny", revision=revision, cache_dir=hf_cache, local_files_only=True
        )
        assert found == str(expected), revision
    with pytest.raises(ConfigError, match=r"revision v9; looked in .*models--org--tiny.*--revision v9"):
        _source("org/tiny", revision="v9")
    # --download-dir is searched instead of HF_HUB_CACHE
    elsewhere = put_in_hf_cache(tmp_path / "elsewhere", "org/only-there", tiny_dir)
    assert _source("org/only-there", download_dir=str(tmp_path / "elsewhere")) == str(elsewhere)
    with pytest.raises(ConfigError, match="org/only-there"):
        _source("org/only-there")


def _tokenizer_repo(tiny_dir: Path, tmp_path: Path, marker: str) -> Path:
    """The model's tokenizer files alone, their chat template marked with `marker`."""
    out = tmp_path / f"tok-{marker}"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_dir / name, out / name)
    (out / "chat_template.jinja").write_text(
        f"{{# {marker} #}}" + (tiny_dir / "chat_template.jinja").read_text()
    )
    return out


def test_the_tokenizer_by_id_and_revision(hf_cache, tiny_dir, tmp_path):
    put_in_hf_cache(hf_cache, "org/tiny", tiny_dir)
    tok_main = put_in_hf_cache(
        hf_cache, "org/tok", _tokenizer_repo(tiny_dir, tmp_path, "main"), refs=("main",)
    )
    tok_v2 = put_in_hf_cache(hf_cache, "org/tok", _tokenizer_repo(tiny_dir, tmp_path, "v2"), refs=("v2",))
    llm = LLM("org/tiny", tokenizer="org/tok", **ENGINE)
    assert llm.engine.config.tokenizer == str(tok_main)
    assert "{# main #}" in llm.get_tokenizer().chat_template
    assert resolve_tokenizer(
        EngineConfig(model="org/tiny", tokenizer="org/tok", tokenizer_revision="v2")
    ) == str(tok_v2)
    assert resolve_tokenizer(EngineConfig(model="org/tiny")) is None  # the model's own
    assert resolve_tokenizer(EngineConfig(model="org/tiny", tokenizer=str(tok_v2))) == str(tok_v2)  # a path
    with pytest.raises(ConfigError, match=r"--tokenizer org/untrained: not a local directory.*hf download"):
        resolve_tokenizer(EngineConfig(model="org/tiny", tokenizer="org/untrained"))


def test_a_missing_id_fails_at_once_naming_it_the_cache_and_the_download(hf_cache):
    start = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        resolve_model_source(EngineConfig(model="org/missing"))
    assert time.perf_counter() - start < 0.5
    message = str(error.value)
    for part in ("--model org/missing", str(hf_cache / "models--org--missing"), "hf download org/missing"):
        assert part in message
    assert "HF_HUB_OFFLINE" in message
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        LLM("org/missing")


def test_a_local_directory_wins_over_an_id_of_the_same_spelling(hf_cache, tiny_dir, tmp_path):
    put_in_hf_cache(hf_cache, "org/tiny", make_tiny_checkpoint("llama", tmp_path / "cached", seed=1))
    shutil.copytree(tiny_dir, Path("org/tiny"))
    assert _source("org/tiny") == str(Path("org/tiny").resolve())


@pytest.fixture(scope="module")
def gguf_dir(tiny_dir, tmp_path_factory) -> Path:
    """A GGUF repository: the tiny model as float32 GGUF, once as tiny-F32.gguf and once as tiny.Q8_0.gguf."""
    from pagellm.bench.gguf_convert import convert_hf_checkpoint

    out = tmp_path_factory.mktemp("gguf-repo")
    convert_hf_checkpoint(tiny_dir, out / "tiny-F32.gguf", "float32")
    shutil.copy(out / "tiny-F32.gguf", out / "tiny.Q8_0.gguf")
    return out


def test_a_gguf_file_by_id(hf_cache, gguf_dir, local_tokens, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "pagellm-cache"))
    snapshot = put_in_hf_cache(hf_cache, "org/tiny-GGUF", gguf_dir)
    f32 = str(snapshot / "tiny-F32.gguf")
    assert _source("org/tiny-GGUF:tiny-F32.gguf") == f32
    assert _source("org/tiny-GGUF:F32") == f32  # a quantization type, vLLM's repo_id:quant_type
    assert _source("org/tiny-GGUF/tiny-F32.gguf") == f32
    assert _source("org/tiny-GGUF", gguf_file="tiny-F32.gguf") == f32
    assert _source("org/tiny-GGUF:q8_0") == str(snapshot / "tiny.Q8_0.gguf")
    with pytest.raises(ConfigError, match=r"a GGUF repository: choose a file.*tiny-F32.gguf, tiny.Q8_0.gguf"):
        _source("org/tiny-GGUF")
    with pytest.raises(ConfigError, match=r"no GGUF file matches 'Q4_K_M'"):
        _source("org/tiny-GGUF:Q4_K_M")
    assert _tokens(LLM("org/tiny-GGUF:F32", **ENGINE)) == local_tokens


def test_serve_an_id_under_its_name(hf_cache, tiny_dir, monkeypatch):
    import uvicorn
    from openai_asgi import call_app

    from pagellm.cli.main import cli
    from pagellm.engine.async_llm import AsyncLLM

    put_in_hf_cache(hf_cache, "org/tiny", tiny_dir)
    seen = {}

    async def ask(client, http):
        seen["models"] = [m.id for m in (await client.models.list()).data]
        reply = await client.completions.create(model="org/tiny", prompt="Hello", max_tokens=4, temperature=0)
        seen["tokens"] = reply.usage.completion_tokens

    def run_once_started(server: uvicorn.Server, sockets=None) -> None:
        gate = server.config.app  # answers 503 "starting" until the engine is up
        deadline = time.monotonic() + 120
        while gate.app is None and time.monotonic() < deadline:
            time.sleep(0.05)
        call_app(gate, ask)

    monkeypatch.setattr(uvicorn.Server, "run", run_once_started)
    start = AsyncLLM.from_config.__func__  # the engine on a thread: a process would only cost start-up time
    monkeypatch.setattr(
        AsyncLLM,
        "from_config",
        classmethod(lambda cls, c, launched=None: start(cls, c, engine_process=False, launched=launched)),
    )
    args = ["serve", "org/tiny", "--port", "0", *_flags(ENGINE)]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert seen == {"models": ["org/tiny"], "tokens": 4}


def _flags(settings: dict) -> list[str]:
    return [x for k, v in settings.items() for x in ("--" + k.replace("_", "-"), str(v))]


def test_the_engine_commands_take_the_hub_flags():
    from pagellm.cli.main import cli

    help_text = CliRunner().invoke(cli, ["serve", "--help"], terminal_width=200).output
    for flag in (
        "--revision",
        "--tokenizer-revision",
        "--download-dir",
        "--gguf-file",
        "--served-model-name",
    ):
        assert flag in help_text


# -- online, with huggingface_hub's network calls replaced ----------------------------------------------


class FakeHub:
    """A repository on a Hub that is not there: list_repo_files answers `files`; hf_hub_download and
    snapshot_download write what they are asked for into the cache (filtered by huggingface_hub's own
    pattern matching) and record the request."""

    def __init__(self, monkeypatch, cache: Path, tmp_path: Path, files: dict[str, str], delay: float = 0.0):
        self.cache, self.files, self.delay = cache, files, delay
        self.origin = tmp_path / "origin"
        for name, content in files.items():
            (self.origin / name).parent.mkdir(parents=True, exist_ok=True)
            (self.origin / name).write_text(content)
        self.requests: list[list[str]] = []
        self.intervals: list[tuple[float, float]] = []
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", self.list_repo_files)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", self.hf_hub_download)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)

    def list_repo_files(self, repo_id, revision=None, **kwargs):  # set on HfApi, called without it
        return sorted(self.files)

    def hf_hub_download(self, repo_id, filename, revision=None, cache_dir=None, **kwargs):
        folder = self.snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=[filename]
        )
        return str(Path(folder) / filename)

    def snapshot_download(self, repo_id, revision=None, cache_dir=None, allow_patterns=None, **kwargs):
        from huggingface_hub.utils import filter_repo_objects

        start = time.monotonic()
        wanted = list(filter_repo_objects(sorted(self.files), allow_patterns=allow_patterns))
        self.requests.append(wanted)
        time.sleep(self.delay)
        folder = put_in_hf_cache(cache_dir, repo_id, self.origin, commit="c" * 40, files=wanted)
        self.intervals.append((start, time.monotonic()))
        return str(folder)

    def downloaded(self) -> list[str]:
        return self.requests[-1]


def _index(*shards: str) -> str:
    return json.dumps({"metadata": {}, "weight_map": {f"w{i}": s for i, s in enumerate(shards)}})


SMALL = {
    "config.json": "{}",
    "generation_config.json": "{}",
    "tokenizer.json": "{}",
    "tokenizer_config.json": "{}",
    "README.md": "",
    ".gitattributes": "",
}


@pytest.mark.parametrize(
    "weights, expected",
    [
        (  # sharded safetensors: only the shards the index names (not a stale one, not the .bin or onnx)
            {
                "model.safetensors.index.json": _index("model-1.safetensors", "model-2.safetensors"),
                "model-1.safetensors": "",
                "model-2.safetensors": "",
                "model-stale.safetensors": "",
                "pytorch_model.bin": "",
                "onnx/model.onnx": "",
                "original/consolidated.00.pth": "",
                "modules.json": "[]",
                "1_Pooling/config.json": "{}",
            },
            [
                "model.safetensors.index.json",
                "model-1.safetensors",
                "model-2.safetensors",
                "modules.json",
                "1_Pooling/config.json",
            ],
        ),
        (  # one safetensors file beats .bin and consolidated weights
            {
                "model.safetensors": "",
                "consolidated.safetensors": "",
                "pytorch_model.bin": "",
                "tf_model.h5": "",
            },
            ["model.safetensors"],
        ),
        (  # .bin only: the shards its index names
            {
                "pytorch_model.bin.index.json": _index("pytorch_model-1.bin", "pytorch_model-2.bin"),
                "pytorch_model-1.bin": "",
                "pytorch_model-2.bin": "",
                "pytorch_model-old.bin": "",
            },
            ["pytorch_model.bin.index.json", "pytorch_model-1.bin", "pytorch_model-2.bin"],
        ),
        (
            {"model-a.safetensors": "", "model-b.safetensors": ""},
            ["model-a.safetensors", "model-b.safetensors"],
        ),
    ],
)
def test_a_download_fetches_the_small_files_and_one_weight_format(
    hf_cache, tmp_path, monkeypatch, weights, expected
):
    small = {k: v for k, v in SMALL.items() if k not in ("README.md", ".gitattributes")}
    hub = FakeHub(monkeypatch, hf_cache, tmp_path, {**SMALL, **weights})
    folder = model_snapshot("org/name", cache_dir=str(hf_cache))
    assert sorted(hub.downloaded()) == sorted([*small, *expected])
    assert folder == str(hf_cache / "models--org--name" / "snapshots" / ("c" * 40))
    assert (hf_cache / ".locks" / "models--org--name" / "pagellm.lock").exists()


@pytest.mark.parametrize(
    "weights, error",
    [
        ({"consolidated.00.pt": ""}, r"no safetensors or pytorch_model\*.bin weights .* consolidated.00.pt"),
        (
            {"name-Q4_K_M.gguf": "", "name-Q8_0.gguf": ""},
            r"a GGUF repository: .*name-Q4_K_M.gguf, name-Q8_0.gguf",
        ),
        (
            {"model.safetensors.index.json": _index("model-1.safetensors")},
            r"index names files .*: model-1.safetensors",
        ),
    ],
)
def test_a_repository_without_readable_weights_is_refused_before_downloading_them(
    hf_cache, tmp_path, monkeypatch, weights, error
):
    hub = FakeHub(monkeypatch, hf_cache, tmp_path, {**SMALL, **weights})
    with pytest.raises(ConfigError, match=error):
        model_snapshot("org/name", cache_dir=str(hf_cache))
    assert all(not any(f.endswith((".pt", ".gguf", ".safetensors")) for f in r) for r in hub.requests)


def test_two_processes_download_one_after_the_other(hf_cache, tmp_path, monkeypatch):
    hub = FakeHub(monkeypatch, hf_cache, tmp_path, {**SMALL, "model.safetensors": ""}, delay=0.3)
    threads = [threading.Thread(target=model_snapshot, args=("org/name",)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (a_start, a_end), (b_start, b_end) = sorted(hub.intervals)
    assert len(hub.intervals) == 2 and a_end <= b_start  # the file lock kept them apart


@pytest.fixture
def silent_hub(monkeypatch):
    """Online, with the Hub at an address that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "0.5")
    yield
    server.close()


def test_a_silent_hub_is_waited_for_a_bounded_time_then_the_cache_serves(
    hf_cache, tiny_dir, silent_hub, caplog
):
    snapshot = put_in_hf_cache(hf_cache, "org/tiny", tiny_dir)
    start = time.perf_counter()
    with caplog.at_level("WARNING", logger="pagellm"):
        assert _source("org/tiny") == str(snapshot)
    assert time.perf_counter() - start < 3
    assert "could not be reached" in caplog.text and "using the cached snapshot" in caplog.text
    start = time.perf_counter()
    with pytest.raises(
        ConfigError, match=r"org/missing: the Hugging Face Hub could not be reached .*models--org--missing"
    ):
        _source("org/missing")
    assert time.perf_counter() - start < 3


def test_an_incomplete_cached_snapshot_names_the_missing_shard(hf_cache, tmp_path):
    repo = tmp_path / "sharded"
    repo.mkdir()
    (repo / "config.json").write_text("{}")
    (repo / "model.safetensors.index.json").write_text(_index("model-1.safetensors", "model-2.safetensors"))
    (repo / "model-1.safetensors").write_text("")
    put_in_hf_cache(hf_cache, "org/sharded", repo)
    with pytest.raises(
        ConfigError, match=r"incomplete \(missing model-2.safetensors\).*hf download org/sharded"
    ):
        _source("org/sharded")


def test_the_lock_folder_is_huggingface_hubs(hf_cache):
    with hub_module.download_lock(str(hf_cache), "org/name"):
        assert (hf_cache / ".locks" / "models--org--name" / "pagellm.lock").exists()


def test_a_failed_download_falls_back_to_the_cache(hf_cache, tiny_dir, tmp_path, monkeypatch, caplog):
    FakeHub(monkeypatch, hf_cache, tmp_path, {**SMALL, "model.safetensors": ""})

    def cut_off(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cut_off)
    with pytest.raises(
        ConfigError, match=r"failed \(OSError: No space left on device\), and it is not in the"
    ):
        model_snapshot("org/tiny")
    snapshot = put_in_hf_cache(hf_cache, "org/tiny", tiny_dir)
    with caplog.at_level("WARNING", logger="pagellm"):
        assert model_snapshot("org/tiny") == str(snapshot)
    assert "No space left on device" in caplog.text and "using the cached snapshot" in caplog.text
