"""`pagellm bench serve` (W2) against a real `pagellm serve`, the llama.cpp peer against a fake llama-server
(tests/bench/fake_llama_server.py), and the GGUF files the peer is given."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from bench_cli import ENGINE_ARGS, FLOOR_ARGS, SMALL_W1, run_bench

from pagellm.bench import serve as w2
from pagellm.bench.gguf_convert import convert_hf_checkpoint, reencode_gguf
from pagellm.bench.llama_cpp import LlamaSetting, server_command
from pagellm.bench.workloads import w1
from pagellm.core.config import EngineConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from tiny import make_tiny_checkpoint  # noqa: E402

FAKE_SERVER = Path(__file__).with_name("fake_llama_server.py")


# -- W2 ---------------------------------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded():
    offsets = w2.poisson_offsets(2000, rate=2.0, seed=0)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert np.mean(np.diff(offsets)) == pytest.approx(0.5, rel=0.1)
    assert w2.poisson_offsets(2000, 2.0, 0) == offsets != w2.poisson_offsets(2000, 2.0, 1)
    assert w2.poisson_offsets(3, float("inf")) == [0.0, 0.0, 0.0]


def test_summary_of_hand_made_records():
    a = w2.RequestRecord(10, 3, 0.0, sent_s=0.0, chunk_s=[0.5, 0.6, 0.8], done_s=0.8, output_tokens=3)
    b = w2.RequestRecord(20, 2, 1.0, sent_s=1.0, chunk_s=[1.2, 1.3], done_s=1.4, output_tokens=2)
    c = w2.RequestRecord(5, 2, 2.0, sent_s=2.0, error="HTTP 400: bad")
    s = w2.summarize([a, b, c], rate=1.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 400: bad"])
    assert s["duration_s"] == pytest.approx(1.4) and s["output_tokens"] == 5
    assert s["request_throughput"] == pytest.approx(2 / 1.4)
    assert s["ttft_ms"]["mean"] == pytest.approx(350)  # 500 and 200 ms
    assert s["tpot_ms"]["mean"] == pytest.approx((150 + 100) / 2)  # (0.8 - 0.5) / 2 and 0.1 / 1
    assert sorted([round(x, 6) for x in a.itl_s + b.itl_s]) == [0.1, 0.1, 0.2]
    assert s["offered_rate"] == pytest.approx(1.0)  # sends at 0, 1, 2
    assert s["served_rate"] == pytest.approx(1 / 0.7)  # first tokens at 0.5 and 1.2
    assert s["completion_rate"] == pytest.approx(1 / 0.6)  # completions at 0.8 and 1.4
    # with no queue, at the median TPOT of 125 ms: 0.5 + 2 x 0.125 and 1.2 + 0.125
    assert s["completion_rate_without_queue"] == pytest.approx(1 / (1.325 - 0.75))
    assert s["ttft_ms_by_third"][:2] == pytest.approx([500, 200]) and s["ttft_ms_by_third"][2] is None
    assert s["exact_output_lengths"]


def test_engine_args_pass_only_what_differs():
    config = EngineConfig(model="/m", dtype="bfloat16", max_num_seqs=8, enable_prefix_caching=False)
    assert w2.engine_args(config) == [
        "--model",
        "/m",
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        "8",
        "--no-enable-prefix-caching",
    ]


@pytest.mark.slow
def test_serve_starts_a_server_and_measures_w2(tiny_model, tmp_path):
    out = tmp_path / "serve.json"
    args = ["serve", "--model", tiny_model, *SMALL_W1, "--request-rate", "20", "--output", str(out)]
    result = run_bench([*args, *ENGINE_ARGS, *FLOOR_ARGS])
    for text in ("TTFT ms", "TPOT ms", "ITL ms", "served/offered", "of the floor"):
        assert text in result.output
    report = json.loads(out.read_text())
    s = report["results"]
    workload = w1(384, 4, (8, 24), (2, 6))
    assert (s["completed"], s["failed"]) == (4, 0)
    assert s["exact_output_lengths"] and s["output_tokens"] == workload.output_tokens
    assert s["input_tokens"] == workload.input_tokens
    assert s["ttft_ms"]["p99"] >= s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["mean"] > 0
    assert s["request_rate"] == 20 and s["served_rate"] > 0
    assert s["floor"]["steps"] >= max(workload.output_lens) and s["floor"]["fraction_of_floor"] > 0
    assert report["config"]["dtype"] == "float32"


# -- llama.cpp ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_llama_server(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """An executable `llama-server` that runs the fake, and the log of what it received."""
    executable = tmp_path / "llama-server"
    executable.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVER}" "$@"\n')
    executable.chmod(executable.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    return executable, log


def test_llama_cpp_peer_sends_the_same_requests(tiny_model, fake_llama_server, tmp_path):
    executable, log = fake_llama_server
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # the fake only checks that it exists
    out = tmp_path / "result.json"
    args = ["throughput", "--model", tiny_model, *SMALL_W1, "--compare", "llama.cpp"]
    args += ["--llama-server", str(executable), "--llama-model", str(gguf), "--llama-slots", "2,4"]
    args += ["--output-json", str(out), *ENGINE_ARGS, *FLOOR_ARGS]
    result = run_bench(args)
    assert "llama.cpp (4 slots, flash attn off)" in result.output
    assert "pagellm / llama.cpp" in result.output
    assert "llama.cpp, every setting: (2 slots, flash attn on)" in result.output
    report = json.loads(out.read_text())
    peer = report["results"]["llama.cpp"]
    assert peer["output_tokens"] == report["workload"]["output_tokens"]
    assert len(peer["extra"]["output_tok_s_by_setting"]) == 4  # 2 slot counts x flash attention on, off
    assert report["ratios"]["llama.cpp"] == pytest.approx(
        report["results"]["pagellm"]["output_tok_s"] / peer["output_tok_s"]
    )
    workload = w1(384, 4, (8, 24), (2, 6))
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 4 * (1 + 4)  # per setting: a warm-up, then the workload
    settings = {(e["flags"]["-np"], e["flags"]["-fa"]) for e in lines}
    assert settings == {("2", "on"), ("2", "off"), ("4", "on"), ("4", "off")}
    for entry in lines:
        flags = entry["flags"]
        assert flags["-m"] == str(gguf) and flags["-t"] == str(torch.get_num_threads())
        assert int(flags["-c"]) == int(flags["-np"]) * 256  # every request fits its slot
    bodies = [e["body"] for e in lines if e["body"]["prompt"] != list(range(1, 17))]
    assert len(bodies) == 4 * 4
    wanted = sorted(zip(map(tuple, workload.prompts), workload.output_lens, strict=True))
    for i in range(4):
        sent = sorted((tuple(b["prompt"]), b["n_predict"]) for b in bodies[4 * i : 4 * i + 4])
        assert sent == wanted
    for body in bodies:
        assert (body["ignore_eos"], body["temperature"], body["cache_prompt"]) == (True, 0, False)


def test_llama_cpp_peer_is_skipped_without_a_binary(tiny_model, tmp_path):
    out = tmp_path / "result.json"
    args = ["throughput", "--model", tiny_model, *SMALL_W1, "--compare", "llama.cpp"]
    result = run_bench([*args, "--output-json", str(out), *ENGINE_ARGS, *FLOOR_ARGS])
    assert "llama.cpp peer skipped: no llama-server given" in result.output
    report = json.loads(out.read_text())
    assert "llama.cpp" not in report["results"] and "llama.cpp" in report["skipped"]


def test_flash_attention_flag_follows_the_binary():
    setting = LlamaSetting(8, "off")
    new = server_command("ls", "m.gguf", 1234, setting, 768, 2, help_text="-fa, --flash-attn [on|off|auto]")
    assert new[new.index("-fa") + 1] == "off" and new[new.index("-c") + 1] == str(8 * 768)
    old = server_command("ls", "m.gguf", 1234, setting, 768, 2, help_text="-fa, --flash-attn  enable")
    assert "-fa" not in old
    assert "-fa" in server_command("ls", "m.gguf", 1234, LlamaSetting(8, "on"), 768, 2, help_text="")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_converted_gguf_generates_like_the_checkpoint(arch, tmp_path):
    """The GGUF written for llama.cpp, read back through transformers' GGUF reader (which undoes llama.cpp's
    q/k permutation), gives the checkpoint's logprobs exactly in float32; re-encoded to bf16 it holds the
    bf16-rounded weights."""
    from gguf import GGUFReader, dequantize

    from pagellm import LLM, SamplingParams

    checkpoint = make_tiny_checkpoint(arch, tmp_path)
    f32 = convert_hf_checkpoint(checkpoint, tmp_path / "model.f32.gguf", "float32")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompt = [{"prompt_token_ids": [5, 17, 42, 99, 200, 7]}]
    runs = [
        LLM(str(path), dtype="float32", kv_cache_space=0.01).generate(prompt, params, use_tqdm=False)[0]
        for path in (checkpoint, f32)
    ]
    a, b = (r.outputs[0] for r in runs)
    assert a.token_ids == b.token_ids
    assert [x[t].logprob for x, t in zip(a.logprobs, a.token_ids, strict=True)] == [
        y[t].logprob for y, t in zip(b.logprobs, b.token_ids, strict=True)
    ]
    bf16 = reencode_gguf(f32, tmp_path / "model.bf16.gguf", "bfloat16")
    source, target = GGUFReader(str(f32)), GGUFReader(str(bf16))
    assert target.fields["general.file_type"].contents() == 32  # MOSTLY_BF16
    assert len(target.tensors) == len(source.tensors)
    for s, t in zip(source.tensors, target.tensors, strict=True):
        assert s.name == t.name
        expected = torch.from_numpy(np.array(dequantize(s.data, s.tensor_type)))
        if expected.ndim >= 2:
            expected = expected.to(torch.bfloat16).float()
        assert torch.equal(torch.from_numpy(np.array(dequantize(t.data, t.tensor_type))), expected)
    assert os.path.getsize(bf16) < os.path.getsize(f32)
