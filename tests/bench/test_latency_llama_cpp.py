"""`pagellm bench latency --compare llama.cpp` against fake llama-bench and llama-batched-bench executables
(small Python scripts written here that print their tool's output shapes and record their arguments), and
the CPU-features line every bench report prints."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
import torch
from bench_cli import ENGINE_ARGS, FLOOR_ARGS, run_bench
from click.testing import CliRunner

from pagellm.bench import llama_bench
from pagellm.bench.common import cpu_features, cpu_line
from pagellm.bench.gguf_convert import convert_hf_checkpoint
from pagellm.cli.main import cli

# llama-bench -o json: one record per test and depth, as tools/llama-bench/llama-bench.cpp prints them
# (its fields, then samples_ns and samples_ts). The rates are made up: prompt tests 1000 tok/s at depth 0 and
# 800 deeper, generation tests 50 tok/s at depth 0 and 40 deeper (a 25 ms step).
FAKE_LLAMA_BENCH = """
import json, os, sys
argv = sys.argv[1:]
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "argv.json"), "w") as f:
    json.dump(argv, f)
flags = dict(zip(argv[::2], argv[1::2]))
if not os.path.isfile(flags["-m"]):
    sys.exit(f"error: failed to load model '{flags['-m']}'")
print("llama_model_loader: loaded meta data ... [noise on stderr]", file=sys.stderr)
records = []
for depth in [int(d) for d in flags.get("-d", "0").split(",")]:
    for n_prompt, n_gen, rate in ((int(flags["-p"]), 0, 1000.0), (0, int(flags["-n"]), 50.0)):
        rate = rate * 0.8 if depth else rate
        ns = int((n_prompt + n_gen) / rate * 1e9)
        records.append({
            "build_commit": "fake", "build_number": 1, "cpu_info": "fake CPU", "backends": "CPU",
            "model_filename": flags["-m"], "model_type": "llama ?B BF16", "n_batch": int(flags["-b"]),
            "n_ubatch": int(flags["-ub"]), "n_threads": int(flags["-t"]), "n_prompt": n_prompt,
            "n_gen": n_gen, "n_depth": depth, "test_time": "2026-12-03T00:00:00Z", "avg_ns": ns,
            "stddev_ns": 0, "avg_ts": rate, "stddev_ts": 0.0, "samples_ns": [ns] * 5,
            "samples_ts": [rate] * 5,
        })
print(json.dumps(records, indent=2))
"""

# llama-batched-bench --output-format jsonl: a results line per (pp, tg, pl); a 100 ms step, 500 prompt tok/s.
FAKE_BATCHED_BENCH = """
import json, os, sys
argv = sys.argv[1:]
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "batched-argv.json"), "w") as f:
    json.dump(argv, f)
flags = dict(zip(argv[::2], argv[1::2]))
if not os.path.isfile(flags["-m"]):
    sys.exit(f"error: failed to load model '{flags['-m']}'")
pp, tg, pl = int(flags["-npp"]), int(flags["-ntg"]), int(flags["-npl"])
print("main: n_kv_max = ... [noise on stderr]", file=sys.stderr)
t_pp, t_tg = pl * pp / 500.0, tg * 0.1
print(json.dumps({"n_kv_max": int(flags["-c"]), "n_batch": int(flags["-b"]), "n_ubatch": int(flags["-ub"]),
    "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": int(flags["-t"]),
    "n_threads_batch": int(flags["-tb"]), "pp": pp, "tg": tg, "pl": pl, "n_kv": pl * (pp + tg), "t_pp": t_pp,
    "speed_pp": pl * pp / t_pp, "t_tg": t_tg, "speed_tg": pl * tg / t_tg, "t": t_pp + t_tg,
    "speed": pl * (pp + tg) / (t_pp + t_tg)}))
"""

SHAPE = ["--input-len", "20", "--output-len", "5"]


def executable(folder: Path, name: str, script: str) -> Path:
    path = folder / name
    path.write_text(f"#!{sys.executable}\n{script}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory) -> Path:
    """The tiny checkpoint as a float32 GGUF, for --model."""
    return convert_hf_checkpoint(tiny_model, tmp_path_factory.mktemp("gguf") / "tiny.f32.gguf", "float32")


def test_batch_one_runs_llama_bench_on_the_model_gguf(tiny_gguf, tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    binary = executable(tools, "llama-bench", FAKE_LLAMA_BENCH)
    out = tmp_path / "latency.json"
    args = ["latency", "--model", str(tiny_gguf), "--batch-size", "1", *SHAPE, "--compare", "llama.cpp"]
    args += ["--llama-bench", str(binary), "--output-json", str(out), *ENGINE_ARGS, *FLOOR_ARGS]
    result = run_bench(args)

    argv = json.loads((tools / "argv.json").read_text())
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    assert flags["-m"] == str(tiny_gguf)  # --model is a GGUF: llama.cpp runs that very file
    assert (flags["-p"], flags["-n"], flags["-d"]) == ("20", "5", "0,20")
    assert flags["-t"] == str(torch.get_num_threads()) and flags["-o"] == "json"
    assert (flags["-b"], flags["-ub"]) == ("2048", "512")

    report = json.loads(out.read_text())
    pagellm, peer = report["results"]["pagellm"], report["results"]["llama.cpp"]
    # the step from the generation test at the prompt's depth, the prefill from the prompt test at depth 0
    assert peer["decode_step_mean_ms"] == pytest.approx(25.0) and peer["prefill_tok_s"] == pytest.approx(1000)
    assert (peer["tool"], peer["gguf"], peer["repetitions"], peer["decode_depth"]) == (
        "llama-bench",
        str(tiny_gguf),
        5,
        20,
    )
    ratios = report["ratios"]["llama.cpp"]
    assert ratios["decode_step"] == pytest.approx(25.0 / pagellm["decode_step_mean_ms"])
    assert ratios["prefill_tok_s"] == pytest.approx(pagellm["prefill_tok_s"] / 1000)
    assert "llama.cpp (llama-bench, mean of 5 runs)" in result.output
    assert (
        f"decode step: llama.cpp 25.00 ms / pagellm {pagellm['decode_step_mean_ms']:.2f} ms" in result.output
    )
    assert f"= {ratios['decode_step']:.2f}x (above 1: pagellm is faster)" in result.output
    assert "/ llama.cpp 1000.0 prompt tok/s" in result.output
    # the CPU line, in the report and in the JSON
    assert cpu_line(cpu_features()) in result.output
    assert report["machine"]["cpu"] == cpu_features()


def test_larger_batches_run_batched_bench_on_the_converted_gguf(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    tools = tmp_path / "bin"
    tools.mkdir()
    binary = executable(tools, "llama-bench", FAKE_LLAMA_BENCH)
    executable(tools, "llama-batched-bench", FAKE_BATCHED_BENCH)
    out = tmp_path / "latency.json"
    args = ["latency", "--model", tiny_model, "--batch-size", "3", *SHAPE, "--compare", "llama.cpp"]
    args += ["--llama-bench", str(binary), "--output-json", str(out), *ENGINE_ARGS, *FLOOR_ARGS]
    result = run_bench(args)

    assert not (tools / "argv.json").exists()  # llama-bench itself runs one sequence: not asked
    argv = json.loads((tools / "batched-argv.json").read_text())
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    assert (flags["-npp"], flags["-ntg"], flags["-npl"]) == ("20", "5", "3")
    assert flags["-t"] == flags["-tb"] == str(torch.get_num_threads()) and flags["--output-format"] == "jsonl"
    assert int(flags["-c"]) >= 3 * (20 + 5)
    # the run's model (a checkpoint folder) written as a GGUF in the run's dtype, in the cache
    assert flags["-m"].startswith(str(tmp_path / "cache" / "llama.cpp")) and flags["-m"].endswith(
        ".float32.gguf"
    )

    peer = json.loads(out.read_text())["results"]["llama.cpp"]
    assert peer["decode_step_mean_ms"] == pytest.approx(100.0) and peer["prefill_tok_s"] == pytest.approx(500)
    assert (peer["tool"], peer["batch_size"], peer["repetitions"]) == ("llama-batched-bench", 3, 1)
    assert "llama.cpp (llama-batched-bench, one run)" in result.output


def test_larger_batches_without_batched_bench_are_skipped_with_the_reason(tmp_path):
    binary = executable(tmp_path, "llama-bench", FAKE_LLAMA_BENCH)
    why = llama_bench.unavailable(str(binary), 4)
    assert "batch 4" in why and "llama-batched-bench" in why and str(binary) in why
    assert llama_bench.unavailable(str(binary), 1) is None
    result, reason = llama_bench.run_llama_bench(str(binary), "m.gguf", 4, 20, 5, 1)
    assert result is None and reason == why and not (tmp_path / "argv.json").exists()


def test_a_failing_llama_bench_is_reported_not_raised(tmp_path):
    binary = executable(tmp_path, "llama-bench", FAKE_LLAMA_BENCH)
    result, reason = llama_bench.run_llama_bench(str(binary), str(tmp_path / "missing.gguf"), 1, 20, 5, 1)
    assert result is None
    assert reason.startswith("llama-bench exited with 1") and "failed to load model" in reason


def test_a_crashing_llama_bench_is_named_with_its_signal_and_the_flag_that_avoids_it(tmp_path):
    """llama.cpp's AMX matmul faulted on an AMX Xeon (SIGSEGV) on every quantized file; `--repack 0` ran it."""
    crash = "import os, signal, sys\nprint('load_tensors: AMX model buffer size', file=sys.stderr)\n"
    crash += "os.kill(os.getpid(), signal.SIGSEGV)\n"
    binary = executable(tmp_path, "llama-bench", crash)
    result, reason = llama_bench.run_llama_bench(str(binary), str(tmp_path / "m.gguf"), 1, 20, 5, 1)
    assert result is None
    assert reason.startswith("llama-bench was killed by SIGSEGV (exit -11)")
    assert '--llama-args "--repack 0"' in reason and "AMX model buffer" in reason


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "--compare llama.cpp needs --llama-bench PATH"),
        (["--llama-bench", "/no/such/llama-bench"], "--llama-bench /no/such/llama-bench: not an executable"),
    ],
)
def test_a_missing_llama_bench_is_refused_before_anything_runs(flags, message):
    args = [
        "--log-level",
        "WARNING",
        "bench",
        "latency",
        "--model",
        "/no/such/model",
        "--compare",
        "llama.cpp",
    ]
    result = CliRunner().invoke(cli, [*args, *flags])
    assert result.exit_code != 0 and message in result.output


def test_parse_llama_bench_json_picks_the_records_of_the_shape():
    records = [
        {"n_prompt": 20, "n_gen": 0, "n_depth": 0, "avg_ns": 20_000_000, "avg_ts": 1000.0, "samples_ts": [1]},
        {"n_prompt": 0, "n_gen": 5, "n_depth": 0, "avg_ns": 100_000_000, "avg_ts": 50.0, "samples_ts": [1]},
    ]
    # a llama-bench without -d: the generation test at depth 0 is what there is; text after the list is noise
    parsed = llama_bench.parse_bench_json(json.dumps(records) + "\nbuild: fake [1]\n", 20, 5)
    assert parsed["decode_step_mean_ms"] == pytest.approx(20.0) and parsed["decode_depth"] == 0
    assert parsed["prefill_tok_s"] == 1000.0
    with pytest.raises(ValueError, match="no pp64 and tg5 records"):
        llama_bench.parse_bench_json(json.dumps(records), 64, 5)


AMD_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13 64-Core Processor
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2

processor\t: 1
model name\t: AMD EPYC 7B13 64-Core Processor
flags\t\t: fpu avx2 avx512f amx_tile
"""

SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu avx2 avx512f avx512dq avx512_vnni avx512_bf16 avx_vnni amx_bf16 amx_tile amx_int8
"""

ICE_LAKE = """model name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz
flags\t\t: fpu avx2 avx512f avx512_vnni
"""


@pytest.mark.parametrize(
    "text, line",
    [
        (AMD_EPYC, "CPU: AMD EPYC 7B13 64-Core Processor (AVX2; no AVX-512, no AMX)"),
        (
            SAPPHIRE_RAPIDS,
            "CPU: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz (AMX, AVX-512 BF16, AVX-512 VNNI, AVX-512F, AVX2)",
        ),
        (
            ICE_LAKE,
            "CPU: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz (AVX-512 VNNI, AVX-512F, AVX2; no AVX-512 BF16, no AMX)",
        ),
        ("model name\t: Old\nflags\t\t: fpu sse2\n", "CPU: Old (no AVX2, no AVX-512, no AMX)"),
        (
            "processor\t: 0\nmodel name\t: Neoverse\nFeatures\t: fp asimd\n",
            "CPU: Neoverse (no x86 feature flags in /proc/cpuinfo)",
        ),
    ],
)
def test_cpu_features_line(text, line):
    assert cpu_line(cpu_features(text)) == line


def test_cpu_features_are_the_first_processors():
    features = cpu_features(AMD_EPYC)  # the second processor's flags are not read
    assert features["avx2"] and not features["avx512f"] and not features["amx"]
    assert features["model"] == "AMD EPYC 7B13 64-Core Processor" and features["flags_listed"]
    amx_tile_only = cpu_features("model name\t: X\nflags\t\t: avx2 avx512f amx_tile\n")
    assert not amx_tile_only["amx"]  # AMX counts with both amx_bf16 and amx_tile


def test_latency_flags_arrive_parsed():
    from pagellm.bench.latency import LatencyArgs
    from pagellm.cli.bench_cmd import bench, bench_args

    flags = ["--compare", "llama.cpp", "--llama-bench", "llama-bench", "--llama-args", "-r 3 -fa on"]
    args = bench_args(LatencyArgs, bench.commands["latency"].make_context("latency", flags).params)
    assert args.compare == ("llama.cpp",) and args.llama_bench == "llama-bench"
    assert args.llama_args == ("-r", "3", "-fa", "on") and args.llama_model is None
    assert llama_bench.bench_command("lb", "m.gguf", 128, 64, 2, args.llama_args)[-6:] == [
        "-o",
        "json",
        "-r",
        "3",
        "-fa",
        "on",
    ]


def test_a_gguf_model_is_reencoded_unless_pagellm_runs_it_as_it_is(
    tiny_model, tiny_gguf, tmp_path, monkeypatch
):
    """llama.cpp gets the weights pagellm runs (latency and throughput alike): --model's file as is for
    `--quantization gguf` (a GGUF file's default) or a file in the run's dtype; a Q8_0 file in a float32 run
    with `--quantization none` (pagellm dequantizes it) is written in float32 first."""
    from pagellm.bench import llama_bench
    from pagellm.core.config import EngineConfig

    q8 = convert_hf_checkpoint(tiny_model, tmp_path / "tiny.q8_0.gguf", "q8_0")
    written = []
    monkeypatch.setattr(
        "pagellm.bench.gguf_convert.reencode_gguf", lambda source, target, dtype: written.append(dtype)
    )
    same = EngineConfig(model=str(tiny_gguf))
    assert llama_bench.gguf_for_latency(same, None, "float32", str(tmp_path)) == str(tiny_gguf)
    packed = EngineConfig(model=str(q8), quantization="gguf")
    assert llama_bench.gguf_for_latency(packed, None, "float32", str(tmp_path)) == str(q8)
    default = EngineConfig(model=str(q8))  # a GGUF file's default: its blocks kept
    assert llama_bench.gguf_for_latency(default, None, "float32", str(tmp_path)) == str(q8)
    widened = EngineConfig(model=str(q8), quantization="none")
    assert llama_bench.gguf_for_latency(widened, None, "float32", str(tmp_path)).endswith(".float32.gguf")
    assert written == ["float32"]
