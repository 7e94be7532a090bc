"""`pagellm serve` before it serves: a busy port fails at once, before the model loads; --help says to pass API
keys in PAGELLM_API_KEY (a flag's value shows in `ps`)."""

from __future__ import annotations

import socket

from click.testing import CliRunner

from pagellm.cli.main import cli
from pagellm.engine.async_llm import AsyncLLM


def test_a_busy_port_fails_before_the_model_loads(tiny_model_dir, monkeypatch):
    loaded = []
    monkeypatch.setattr(AsyncLLM, "from_config", classmethod(lambda cls, config: loaded.append(config)))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(cli, ["serve", str(tiny_model_dir), "--port", str(port)])
    assert result.exit_code == 1, result.output
    assert f"cannot listen on 127.0.0.1:{port}" in result.output and "--port" in result.output
    assert loaded == []


def test_help_says_to_pass_the_api_key_in_the_environment():
    result = CliRunner().invoke(cli, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0
    help_text = " ".join(result.output.split())
    assert "Pass keys in PAGELLM_API_KEY rather than here" in help_text and "`ps`" in help_text
    assert "--max-n" in help_text and "--max-request-body-mb" in help_text
