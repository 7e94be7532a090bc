"""A front end loads its tokenizer while its engine starts in another process (`TokenizerPreload`), from where
the engine will most likely say it is (`likely_tokenizer_path`); the engine's word decides."""

from __future__ import annotations

import shutil
from pathlib import Path

from tiny import make_tiny_checkpoint

from pagellm.core.config import EngineConfig
from pagellm.engine.tokenizer import TokenizerPreload, likely_tokenizer_path
from pagellm.models import gguf_checkpoint


def test_the_likely_path_is_a_local_directory_or_a_gguf_files_converted_copy(tmp_path, monkeypatch):
    model = make_tiny_checkpoint("llama", tmp_path / "model")
    assert likely_tokenizer_path(EngineConfig(model=str(model))) == str(model)
    assert likely_tokenizer_path(EngineConfig(model=str(model), tokenizer=str(tmp_path))) == str(tmp_path)
    assert likely_tokenizer_path(EngineConfig(model="org/not-resolved-here")) is None
    assert likely_tokenizer_path(EngineConfig(model=str(model), tokenizer="org/tokenizer")) is None

    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # only its path, size and time key the copy
    config = EngineConfig(model=str(gguf))
    assert likely_tokenizer_path(config) is None, "a first start converts it: nothing to guess"
    copy = gguf_checkpoint._converted_path(gguf.resolve(), tmp_path / "cache")
    shutil.copytree(model, copy)
    assert gguf_checkpoint.converted_copy(gguf, tmp_path / "cache") == copy
    assert likely_tokenizer_path(config) == str(copy)


def test_the_preloaded_tokenizer_is_used_only_where_the_engine_names_its_path(tmp_path):
    model = make_tiny_checkpoint("llama", tmp_path / "model")
    other = Path(shutil.copytree(model, tmp_path / "other"))
    preload = TokenizerPreload(EngineConfig(model=str(model)))
    preloaded = preload.tokenizer(str(model))
    assert preloaded is preload.loaded and preloaded is not None
    fresh = preload.tokenizer(str(other))
    assert fresh is not preloaded and fresh.get_vocab() == preloaded.get_vocab()


def test_a_gguf_files_first_start_preloads_the_copy_the_engine_converts_meanwhile(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(TokenizerPreload, "POLL_S", 0.01)
    model = make_tiny_checkpoint("llama", tmp_path / "model")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # only its path, size and time key the copy
    preload = TokenizerPreload(EngineConfig(model=str(gguf)))
    preload.join(0.2)
    assert preload.is_alive() and preload.loaded is None, "it waits for the engine's conversion"
    copy = gguf_checkpoint._converted_path(gguf.resolve(), tmp_path / "cache")
    # as the engine's start writes it: a whole directory renamed into place (a copy made in place could be
    # seen, and loaded, before its tokenizer files are in it)
    staged = Path(shutil.copytree(model, copy.with_name(copy.name + ".tmp")))
    staged.rename(copy)
    preload.join(30)
    assert not preload.is_alive() and preload.loaded is not None
    assert preload.tokenizer(str(copy)) is preload.loaded


def test_the_wait_ends_when_the_engine_reports_its_path_first(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_checkpoint("llama", tmp_path / "model")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    preload = TokenizerPreload(EngineConfig(model=str(gguf)))
    tokenizer = preload.tokenizer(str(model))  # the engine reported another path: loaded afresh
    assert not preload.is_alive() and tokenizer is not None and preload.loaded is None
