"""The CPU platform on this machine: facts, memory, the KV-cache budget and config defaults."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.core.platform import GiB
from pagellm.platforms import cpu, cpu_linear
from pagellm.platforms.cpu import CpuPlatform


def proc_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    return set()


def fake_meminfo(monkeypatch, total_gib: float, available_gib: float):
    meminfo = {"MemTotal": int(total_gib * GiB), "MemAvailable": int(available_gib * GiB)}
    monkeypatch.setattr(cpu, "_meminfo", lambda: meminfo)


def test_available_with_model_and_cores():
    a = CpuPlatform.availability()
    assert a.ok
    assert a.reason == f"{CpuPlatform.device_name()}, {len(os.sched_getaffinity(0))} core(s) usable"


def test_describe_has_cores_threads_memory_and_isa():
    facts = CpuPlatform.describe()
    assert facts["cores_usable"] == str(len(os.sched_getaffinity(0)))
    assert facts["torch_threads"] == str(torch.get_num_threads())
    assert facts["device"] and facts["memory_total"].endswith("GiB")
    flags = proc_flags()
    for feature in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"):
        assert facts[feature] == ("yes" if feature in flags else "no")


def test_default_dtype_matches_this_cpu():
    native_bf16 = bool(proc_flags() & {"avx512_bf16", "amx_bf16"})
    assert CpuPlatform.default_dtype == (torch.bfloat16 if native_bf16 else torch.float32)


@pytest.mark.parametrize(
    "flags, dtype",
    [({"avx2", "avx512f"}, torch.float32), ({"avx512_bf16"}, torch.bfloat16), ({"amx_bf16"}, torch.bfloat16)],
)
def test_default_dtype_from_isa(monkeypatch, flags, dtype):
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: flags)
    assert CpuPlatform.default_dtype == dtype
    assert CpuPlatform.describe()["default_dtype"] == str(dtype).removeprefix("torch.")


def test_memory_from_proc_meminfo():
    total, free = CpuPlatform.total_memory(), CpuPlatform.free_memory()
    assert 0 < free <= total
    assert total == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_meminfo_parses_kib(monkeypatch):
    text = "MemTotal:  2048 kB\nMemFree: 10 kB\nMemAvailable: 1024 kB\nHugePages_Total: 0\n"
    monkeypatch.setattr(cpu, "_read_text", lambda path: text)
    assert CpuPlatform.total_memory() == 2048 * 1024
    assert CpuPlatform.free_memory() == 1024 * 1024


def test_meminfo_falls_back_to_sysconf_without_proc(monkeypatch):
    monkeypatch.setattr(cpu, "_read_text", lambda path: "")
    assert CpuPlatform.total_memory() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < CpuPlatform.free_memory() <= CpuPlatform.total_memory()
    assert CpuPlatform.device_name()  # no /proc/cpuinfo: the model name comes from `platform`


def test_memory_in_use_is_only_the_model(monkeypatch):
    fake_meminfo(monkeypatch, total_gib=16, available_gib=3)  # other processes' RAM is not this device's
    assert CpuPlatform.memory_in_use(model_bytes=10 << 20) == 10 << 20


def test_kv_cache_bytes_honours_kv_cache_space():
    config = EngineConfig(kv_cache_space=0.25)
    assert CpuPlatform.kv_cache_bytes(config, model_bytes=10 << 20, peak_bytes=20 << 20) == GiB // 4


def test_kv_cache_bytes_defaults_to_4_gib(monkeypatch):
    fake_meminfo(monkeypatch, total_gib=16, available_gib=8)
    assert CpuPlatform.kv_cache_bytes(EngineConfig(), 0, 0) == 4 * GiB


def test_kv_cache_bytes_refuses_more_than_available(monkeypatch):
    fake_meminfo(monkeypatch, total_gib=16, available_gib=3)
    with pytest.raises(ConfigError, match=r"kv_cache_space 4 GiB .* 3.0 GiB .*lower --kv-cache-space to 3.0"):
        CpuPlatform.kv_cache_bytes(EngineConfig(kv_cache_space=4), 0, 0)


def test_kv_cache_bytes_refuses_more_than_this_machine_has():
    with pytest.raises(ConfigError, match="--kv-cache-space"):
        CpuPlatform.kv_cache_bytes(EngineConfig(kv_cache_space=1 << 20), 0, 0)


def test_check_and_update_config_defaults_kv_cache_space():
    config = EngineConfig(tensor_parallel_size=2, gpu_memory_utilization=5.0)
    CpuPlatform.check_and_update_config(config)
    assert config.kv_cache_space == 4.0
    assert config.tensor_parallel_size == 2 and config.gpu_memory_utilization == 5.0  # not CPU settings
    config = EngineConfig(kv_cache_space=1.5)
    CpuPlatform.check_and_update_config(config)
    assert config.kv_cache_space == 1.5


def test_check_and_update_config_sets_a_cpu_sized_token_budget():
    """A CPU step of 2048 prompt tokens takes seconds, every running decode waiting through it: the CPU
    default is 512, at least one token per sequence, and a value given is kept."""
    config = EngineConfig()
    CpuPlatform.check_and_update_config(config)
    assert config.max_num_batched_tokens == config.token_budget == 512
    config = EngineConfig(max_num_seqs=1024)
    CpuPlatform.check_and_update_config(config)
    assert config.token_budget == 1024
    config = EngineConfig(max_num_batched_tokens=4096)
    CpuPlatform.check_and_update_config(config)
    assert config.token_budget == 4096


def test_check_and_update_config_refuses_empty_kv_cache():
    with pytest.raises(ConfigError, match="kv_cache_space must be more than 0"):
        CpuPlatform.check_and_update_config(EngineConfig(kv_cache_space=0))


@pytest.fixture(params=["amx", "pairs", "onednn", "panel"])
def matmul_impl(request, monkeypatch):
    """Each packed matmul the CPU platform has for bfloat16: pagellm's AMX kernel (AMX CPUs), its AVX-512
    BF16 pair kernel (CPUs with it), oneDNN, and pagellm's panel kernel (where oneDNN cannot pack bfloat16;
    forced here wherever the kernels build)."""
    if request.param == "pairs":
        if cpu._bf16_pair_kernels() is None:
            pytest.skip("no AVX-512 BF16 pair kernel here (CPU without AVX-512 BF16, or no compiler)")
        monkeypatch.setattr(cpu, "_amx_kernels", lambda: None)
        return request.param
    monkeypatch.setattr(cpu, "_bf16_pair_kernels", lambda: None)
    if request.param == "panel":
        if cpu._kernels() is None:
            pytest.skip("no native kernels here")
        monkeypatch.setattr(cpu, "_amx_kernels", lambda: None)
        monkeypatch.setattr(cpu, "onednn_packs", lambda dtype: False)
        return request.param
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    if request.param == "amx":
        if cpu._amx_kernels() is None:
            pytest.skip("no AMX kernel here (CPU without AMX, or no compiler)")
    else:
        if not cpu.onednn_packs(torch.bfloat16):
            pytest.skip("oneDNN cannot pack bfloat16 on this CPU (no AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
        monkeypatch.setattr(cpu, "_amx_kernels", lambda: None)
    return request.param


@pytest.mark.parametrize("rows", [1, 7, 64, 300, 1100])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (37, 100)])
def test_packed_linear_matches_f_linear(matmul_impl, rows, bias, out_features, in_features):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    packed = CpuPlatform.pack_linear(weight)
    assert isinstance(packed.matmul, cpu._AmxLinear) == (matmul_impl == "amx")
    assert isinstance(packed.matmul, cpu_linear.PairLinear) == (matmul_impl == "pairs")
    x = torch.randn(2, rows, in_features, generator=gen).bfloat16()[1]  # a view with an offset
    out = packed.matmul(x, packed.weight, b)
    expected = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
    # both sum bf16 products in float32 (in their own order) and round once: within one bf16 rounding
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-3)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)


def test_amx_linear_op_is_the_kernel_and_takes_any_leading_shape():
    """The op a compiled graph calls is the C++ function itself (no Python custom-op layer), and it
    flattens x and rounds it to bf16 as the eager wrapper did."""
    if cpu._amx_kernels() is None:
        pytest.skip("no AMX kernel here (CPU without AMX, or no compiler)")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 64, generator=gen).bfloat16()
    packed = CpuPlatform.pack_linear(weight)
    x = torch.randn(2, 3, 64, generator=gen)  # float32, 3-d
    out = torch.ops.pagellm.amx_linear(x, packed.weight, None, 40)
    expected = torch.nn.functional.linear(x.bfloat16().float(), weight.float())
    assert out.shape == (2, 3, 40) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-3)
    assert torch.equal(out, packed.matmul(x.bfloat16(), packed.weight, None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 99), (70, 64), (16, 101), (5, 7)])
def test_amx_packing_lays_out_vnni_tiles(dtype, out_features, in_features):
    """The AMX layout, [N/16][K/kt][16][64 bytes] with each tile row the 16 columns' next groups of 2 (bf16)
    or 4 (int8) k values, zero-padded; an odd K's last partial group included."""
    if cpu._amx_kernels() is None:
        pytest.skip("no AMX kernel here (CPU without AMX, or no compiler)")
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=gen).mul(40).to(dtype)
    group = 2 if dtype == torch.bfloat16 else 4
    per_tile = 16 * group
    panels, tiles = -(-out_features // 16), -(-in_features // per_tile)
    padded = weight.new_zeros(panels * 16, tiles * per_tile)
    padded[:out_features, :in_features] = weight
    expected = padded.view(panels, 16, tiles, 16, group).permute(0, 2, 3, 1, 4).reshape(panels, tiles, 16, -1)
    kernels = cpu._amx_kernels()
    packed = kernels.amx_pack(weight) if dtype == torch.bfloat16 else kernels.amx_pack_int8(weight)
    assert torch.equal(packed, expected)


@pytest.mark.parametrize("in_features", [64, 100])
@pytest.mark.parametrize("rows", [1, 3, 15])
def test_amx_rows_below_a_tile_equal_their_rows_in_a_whole_tile(rows, in_features):
    """Fewer x rows than a tile (16) are multiplied in tiles of that many rows where K fills whole tiles
    (64), else copied into a padded tile (100): either way each row's output is the one it gets among 16."""
    if cpu._amx_kernels() is None:
        pytest.skip("no AMX kernel here (CPU without AMX, or no compiler)")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(70, in_features, generator=gen).bfloat16()
    bias = torch.randn(70, generator=gen).bfloat16()
    packed = CpuPlatform.pack_linear(weight)
    x = torch.randn(16, in_features, generator=gen).bfloat16()
    whole = packed.matmul(x, packed.weight, bias)
    assert torch.equal(packed.matmul(x[:rows], packed.weight, bias), whole[:rows])
    assert torch.equal(packed.matmul(x[-rows:], packed.weight, bias), whole[-rows:])


def test_compile_drops_stride_asserts_and_the_python_wrapper(monkeypatch):
    """~400 stride checks a decode step, on outputs that are contiguous by construction; and the graph's
    wrapper in C++ (its Python version cost ~6 ms of a 80 ms decode step on model S)."""
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: seen.update(kwargs) or model)
    model = torch.nn.Linear(2, 2)
    assert CpuPlatform.compile_model(model) is model or shutil.which("c++") is None
    if seen:
        assert seen["options"]["size_asserts"] is False and seen["options"]["alignment_asserts"] is False
        assert seen["options"]["cpp_wrapper"] is True


def test_half_precision_packs_for_onednn():
    if not cpu.onednn_packs(torch.float16):
        pytest.skip("oneDNN cannot pack float16 on this CPU")
    packed = CpuPlatform.pack_linear(torch.randn(32, 64).half())
    assert packed.matmul is cpu._onednn_linear  # the AMX kernel is bfloat16 only


def test_float32_packs_for_the_panel_kernel_on_avx2_only_cpus(monkeypatch):
    """AVX2-only CPUs: float32 on pagellm's panel kernel (MKL's GEMM, F.linear's, measured 1.1-4x slower
    at decode sizes on an AMD EPYC); AVX-512 CPUs keep F.linear."""
    kernels = cpu._kernels()
    if kernels is None:
        pytest.skip("no native kernels here")
    for isa, packs in (("avx2", True), ("avx512", False), ("avx512+amx", False)):
        monkeypatch.setattr(cpu, "_kernels", lambda isa=isa: SimpleNamespace(isa=lambda: isa))
        packed = CpuPlatform.pack_linear(torch.randn(32, 64))
        assert (packed is not None) == packs
        if packs:
            assert isinstance(packed.matmul, cpu_linear.PanelLinear) and packed.weight.dtype == torch.float32


def test_packed_linear_compiles(matmul_impl, tmp_path, monkeypatch):
    """Inductor cannot lower a prepacked weight; the packed matmul must stay one opaque op in the graph
    (before, the whole model fell back to eager with a warning whenever its linears were packed)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=gen).bfloat16(), torch.randn(96, generator=gen).bfloat16()
    packed = CpuPlatform.pack_linear(weight)

    def layer(x):
        return torch.relu(packed.matmul(x * 2, packed.weight, bias)) + 1

    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for rows in (3, 17):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        torch.testing.assert_close(compiled(x), layer(x))


def test_runner_packs_float32_linears_on_avx2_and_keeps_transformers_tokens(tmp_path):
    """A float32 model on an AVX2-only CPU: every linear and the lm_head on the panel kernel, and greedy
    tokens stay transformers' (MKL's GEMM; the sums differ only in order)."""
    from parity import Reference, assert_greedy_parity, mixed_prompts
    from tiny import make_tiny_checkpoint

    from pagellm import LLM
    from pagellm.models.layers.linear import Linear

    if cpu._kernels() is None or cpu._kernels().isa() != "avx2":
        pytest.skip("not an AVX2-only CPU with the native kernels")
    path = make_tiny_checkpoint("llama", tmp_path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, enforce_eager=True)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.packed_matmul, cpu_linear.PanelLinear) for m in linears)
    assert model.packed_lm_head is not None
    assert_greedy_parity(llm, Reference(path, 8), mixed_prompts(llm.get_tokenizer().vocab_size))


def test_runner_packs_linears_and_lm_head_in_half_precision(tmp_path):
    from tiny import make_tiny_checkpoint

    from pagellm import LLM

    for tied in (False, True):
        path = make_tiny_checkpoint("llama", tmp_path / f"tied{tied}", tie_word_embeddings=tied)
        # AMX, oneDNN, or else the panel kernel (tests/platforms/test_cpu_linear.py)
        packs = cpu.onednn_packs(torch.bfloat16) or cpu._kernels() is not None
        avx2_only = cpu._kernels() is not None and cpu._kernels().isa() == "avx2"
        for dtype, packed in (("bfloat16", packs), ("float32", avx2_only)):
            _check_packing(LLM(str(path), dtype=dtype, num_kv_blocks=64, enforce_eager=True), packed, tied)


def _check_packing(llm, packed: bool, tied: bool) -> None:
    from pagellm.models.layers.linear import Linear
    from pagellm.models.loader import model_weight_bytes

    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    assert linears and all((m.packed_matmul is not None) == packed for m in linears)
    assert all((m.weight is None) == packed for m in linears)  # the packed copy replaces the weight
    assert model_weight_bytes(model) == llm.engine.runner.model_bytes  # and is counted like it
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0
    # the output projection too: a packed copy beside a tied embedding, in place of an untied weight
    assert (model.packed_lm_head is not None) == packed
    assert (model.lm_head.weight is None) == (packed and not tied)
    if packed and tied:
        dtype = model.lm_head.weight.dtype
        hidden = torch.randn(5, model.lm_head.weight.shape[1]).to(dtype)
        expected = torch.nn.functional.linear(hidden, model.lm_head.weight)
        logits = model.compute_logits(hidden)
        assert logits.dtype == dtype  # not widened: the sampler does that only where it computes
        torch.testing.assert_close(
            logits, expected, rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [1, 15, 16, 37, 49152])
def test_argmax_is_torchs(dtype, vocab):
    """The native argmax (greedy sampling) equals max(dim=-1).indices: the first of tied maxima, the first
    NaN where a row has one, -inf rows, a slice whose rows are not adjacent."""
    if cpu._kernels() is None:
        pytest.skip("no native kernels here")
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab + 3, generator=gen).to(dtype)
    logits[1] = 2.0  # all tied
    logits[2] = -float("inf")
    logits[3, vocab // 2] = logits[3, vocab - 1] = 100.0  # tie between two maxima
    logits[4, vocab - 1] = float("nan")
    logits[5, 0] = logits[5, vocab // 2] = float("nan")
    logits[6] = logits[6].round()  # many ties
    rows = logits[:, :vocab]  # a view: row stride vocab + 3
    assert torch.equal(CpuPlatform.argmax(rows), rows.max(dim=-1).indices)
    assert torch.equal(cpu._kernels().argmax_rows(rows), rows.max(dim=-1).indices)


def test_argmax_falls_back_to_torch_without_the_kernels(monkeypatch):
    monkeypatch.setattr(cpu, "_kernels", lambda: None)
    logits = torch.randn(4, 33, dtype=torch.float16)
    assert torch.equal(CpuPlatform.argmax(logits), logits.max(dim=-1).indices)


def test_a_cpu_where_onednn_cannot_pack_keeps_plain_linears(monkeypatch):
    """An AVX2-only CPU (AMD Zen 3 here): oneDNN's half-precision reorder raises, so float16 is not packed
    (and bfloat16 only by the panel kernel, where the kernels build) instead of failing at load."""
    monkeypatch.setattr(cpu, "_amx_kernels", lambda: None)
    monkeypatch.setattr(cpu, "onednn_packs", lambda dtype: False)
    monkeypatch.setattr(cpu, "_kernels", lambda: None)
    assert CpuPlatform.pack_linear(torch.randn(32, 64).bfloat16()) is None
    assert CpuPlatform.pack_linear(torch.randn(32, 64).half()) is None


def test_onednn_packs_answers_what_the_reorder_does():
    for dtype in (torch.bfloat16, torch.float16):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), 64)
            torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=dtype), packed, None, "none", [], "")
            works = True
        except RuntimeError:
            works = False
        assert cpu.onednn_packs(dtype) == (works and torch.backends.mkldnn.is_available())


def test_a_killed_builds_leftover_lock_does_not_hang_the_next_start():
    """torch's build lock (`lock` in the build folder) outlives a build that was killed; a later start used
    to wait on it forever. Under pagellm's own lock (released by the OS when its holder dies) it is stale."""
    import subprocess
    import sys

    from pagellm.platforms import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip(f"no native kernels here: {cpu_kernels.why_unavailable()}")
    lock = kernels.library.parent / "lock"
    lock.touch()
    stale = 946684800  # 2000-01-01: this lock's time, which no live build's lock has
    os.utime(lock, (stale, stale))
    code = "from pagellm.platforms import cpu_kernels; assert cpu_kernels.load() is not None"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=240)
    # another process's start (a parallel test's engine) may hold a lock of its own there meanwhile
    assert not lock.exists() or lock.stat().st_mtime != stale
