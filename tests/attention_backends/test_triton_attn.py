"""TRITON_ATTN under the Triton interpreter on CPU tensors (the `triton_interpreter` fixture: the kernel is
jitted per mode, so the rest of a session keeps compiled kernels)."""

import importlib.util

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")

from pagellm.attention_backends import triton_attn  # noqa: E402
from pagellm.attention_backends.triton_attn import TritonAttnBackend  # noqa: E402
from pagellm.core.attention import AttentionSpec  # noqa: E402
from pagellm.core.platform import Platform  # noqa: E402
from pagellm.testing.attention import check_backend, make_paged_batch  # noqa: E402

# (seq_lens, query_lens): a prefill, a chunk over cached context spanning several query tiles, decodes
MIXED = [([17, 40, 5, 33], [17, 9, 1, 1])]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


class _CUDA(Platform):
    name = "testcuda"
    device_type = "cuda"


class _CPU(Platform):
    name = "testcpu"
    device_type = "cpu"


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_dtypes(dtype):
    spec = AttentionSpec(8, 2, 64, dtype, block_size=16)
    assert check_backend(TritonAttnBackend, spec, "cpu", MIXED) < TOLERANCE[dtype]


@pytest.mark.parametrize("head_size", [80, 96])
def test_head_sizes_padded_to_a_power_of_two(head_size):
    spec = AttentionSpec(4, 4, head_size, torch.float32, block_size=16)
    assert check_backend(TritonAttnBackend, spec, "cpu", MIXED) < 1e-5


@pytest.mark.parametrize("block_size", [32, 64])
def test_block_sizes_and_boundaries(block_size):
    b = block_size
    spec = AttentionSpec(8, 1, 64, torch.float32, block_size=b)
    assert check_backend(TritonAttnBackend, spec, "cpu", [([b - 1, b + 1, 2 * b], [b - 1, 3, 1])]) < 1e-5


def test_sliding_window_with_uneven_groups():
    spec = AttentionSpec(9, 3, 64, torch.float32, block_size=16, sliding_window=7)
    assert check_backend(TritonAttnBackend, spec, "cpu", MIXED) < 1e-5


@pytest.mark.parametrize(
    "features",
    [
        dict(logits_soft_cap=5.0),
        dict(logits_soft_cap=30.0, scale=0.1, sliding_window=20),
        dict(has_sinks=True),
        dict(has_sinks=True, sliding_window=7, logits_soft_cap=5.0),
    ],
    ids=["soft_cap", "soft_cap-scale-window", "sinks", "sinks-soft_cap-window"],
)
def test_soft_cap_and_sinks(features):
    spec = AttentionSpec(9, 3, 64, torch.float32, block_size=16, **features)
    assert check_backend(TritonAttnBackend, spec, "cpu", MIXED) < 1e-5


def test_kv_cache_dtype_differs():
    spec = AttentionSpec(8, 2, 64, torch.float16, kv_cache_dtype=torch.float32)
    assert check_backend(TritonAttnBackend, spec, "cpu", [([20, 5], [4, 1])]) < TOLERANCE[torch.float16]


def test_unsupported_reasons(monkeypatch):
    spec = AttentionSpec(32, 8, 128, torch.bfloat16, block_size=32, sliding_window=4096)
    assert TritonAttnBackend.unsupported_reasons(spec, _CUDA) == []
    assert TritonAttnBackend.unsupported_reasons(spec, _CPU) == ["runs on device types cuda, xpu, not cpu"]
    capped = AttentionSpec(
        64, 8, 64, torch.bfloat16, 16, sliding_window=128, logits_soft_cap=30.0, has_sinks=True
    )
    assert TritonAttnBackend.unsupported_reasons(capped, _CUDA) == []
    odd = AttentionSpec(32, 1, 72, torch.float32, block_size=8)
    assert TritonAttnBackend.unsupported_reasons(odd, _CUDA) == [
        "head size 72 not in [64, 80, 96, 128, 256]",
        "block size 8 not in [16, 32, 64]",
        "more than 16 query heads per KV head",
    ]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
    )
    assert TritonAttnBackend.unsupported_reasons(spec, _CUDA) == [
        "the triton package is not installed (pip install triton)"
    ]
    assert triton_attn.PAGELLM_PLUGIN_API == "1.0"


def test_interpreter_mode_is_read_without_triton_knobs(monkeypatch):
    """`triton.knobs` exists from Triton 3.4 on; older Tritons are read through TRITON_INTERPRET (issue 17)."""
    import triton

    monkeypatch.delattr(triton, "knobs", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_attn._interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_attn._interpreting()


def _record_plans(monkeypatch) -> list:
    """Every TilePlan the backend makes from here on, in order."""
    plans = []
    plan_tiles = triton_attn._plan_tiles

    def record(*args):
        plans.append(plan_tiles(*args))
        return plans[-1]

    monkeypatch.setattr(triton_attn, "_plan_tiles", record)
    return plans


# decodes over contexts of 9, 1, 5 and 2 blocks of 16; then a chunk over cached context beside decodes
SPLIT_STEPS = [([140, 7, 70, 20], [1, 1, 1, 1]), ([140, 30, 5, 20], [20, 9, 1, 1])]


@pytest.mark.parametrize(
    "window", [None, pytest.param(20, marks=pytest.mark.slow)], ids=["full", "window-20"]
)
@pytest.mark.parametrize(
    "heads",
    [
        pytest.param((2, 2), id="group-1", marks=pytest.mark.slow),
        pytest.param((4, 2), id="group-2", marks=pytest.mark.slow),
        pytest.param((7, 1), id="group-7"),
    ],
)
@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
def test_split_k_on_and_off(monkeypatch, split, heads, window):
    """Issue 17: with few programs for the device's SMs (here the interpreter's stand-in count) each tile
    walks a slice of its context and a second kernel merges the slices; without, one pass. Both match the
    reference over contexts crossing many blocks, GQA groups of 1, 2 and 7, windows, mixed steps."""
    monkeypatch.setattr(triton_attn, "INTERPRETER_COMPUTE_UNITS", 12 if split else 1)
    plans = _record_plans(monkeypatch)
    spec = AttentionSpec(*heads, 64, torch.float32, block_size=16, sliding_window=window)
    assert check_backend(TritonAttnBackend, spec, "cpu", SPLIT_STEPS) < 1e-5
    splits = [plan.num_splits for plan in plans]
    # plans: the cached prefill and the decodes of the first step, then those of the mixed one
    assert (splits[1] > 1 and splits[3] > 1) if split else set(splits) == {1}


@pytest.mark.parametrize("features", [dict(has_sinks=True), dict(has_sinks=True, logits_soft_cap=5.0)])
def test_split_k_with_sinks(monkeypatch, features):
    """Only the first slice of a split context counts the sink; the merge weighs it like any slice."""
    monkeypatch.setattr(triton_attn, "INTERPRETER_COMPUTE_UNITS", 12)
    plans = _record_plans(monkeypatch)
    spec = AttentionSpec(4, 2, 64, torch.float32, block_size=16, sliding_window=100, **features)
    assert check_backend(TritonAttnBackend, spec, "cpu", SPLIT_STEPS) < 1e-5
    assert plans[1].num_splits > 1 and plans[3].num_splits > 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_split_k_in_half_precision(monkeypatch, dtype):
    monkeypatch.setattr(triton_attn, "INTERPRETER_COMPUTE_UNITS", 16)
    spec = AttentionSpec(8, 2, 64, dtype, block_size=16)
    assert check_backend(TritonAttnBackend, spec, "cpu", SPLIT_STEPS[:1]) < TOLERANCE[dtype]


def test_several_splits_per_request(monkeypatch):
    """Two decodes on one KV head are 2 programs for 16 "SMs": 8 slices wanted, and the longest context
    has 19 key tiles of 16 (head size 128 in float32), so 8 slices each."""
    monkeypatch.setattr(triton_attn, "INTERPRETER_COMPUTE_UNITS", 16)
    plans = _record_plans(monkeypatch)
    spec = AttentionSpec(4, 1, 128, torch.float32, block_size=16)
    assert check_backend(TritonAttnBackend, spec, "cpu", [([300, 3], [1, 1])]) < 1e-5
    decode = plans[-1]
    assert (decode.block_m, decode.tile_reqs.tolist(), decode.num_splits) == (16, [0, 1], 8)


def test_tiles_are_sized_per_step():
    """Decode steps get 16-row tiles holding one group per request, prefills up to 64 rows; the split
    count fills the SMs (a power of two, at most MAX_SPLITS), bounded by the longest context's key tiles."""
    plan = triton_attn._plan_tiles
    decode = make_paged_batch([1000, 17], [1, 1], 16)
    p = plan(decode, 2, 2, 0, 64, 64, 132)  # group, KV heads, window, BLOCK_N, max BLOCK_M, SMs
    assert (p.block_m, p.tile_reqs.tolist(), p.tile_firsts.tolist(), p.num_splits) == (16, [0, 1], [0, 0], 16)
    assert plan(decode, 2, 2, 100, 64, 64, 132).num_splits == 2  # the window sees 2 key tiles
    assert plan(decode, 2, 2, 0, 64, 64, 4).num_splits == 1  # 4 programs fill 4 SMs
    prefill = make_paged_batch([100, 20], [100, 3], 16)
    p = plan(prefill, 2, 2, 0, 64, 64, 132)
    assert (p.block_m, p.tile_reqs.tolist(), p.tile_firsts.tolist()) == (
        64,
        [0, 0, 0, 0, 1],
        [0, 32, 64, 96, 0],
    )
    assert p.num_splits == 2  # 10 programs want 14 slices; 100 keys are 2 tiles of 64
    speculative = make_paged_batch([50, 60], [3, 2], 16)
    assert plan(speculative, 4, 2, 0, 64, 64, 132).block_m == 16  # 3 tokens x 4 heads


def test_tile_limits_and_compute_units_for_cuda(monkeypatch):
    """8 KiB of keys per loop step, at most 16 KiB of queries per tile, 8 warps for the largest tiles
    (fewer spill registers); the SM count comes from the device's properties (CUDA, ROCm:
    multi_processor_count; XPU: gpu_subslice_count)."""
    assert triton_attn._tile_limits(64, 2) == (64, 64)
    assert triton_attn._tile_limits(128, 2) == (32, 64)
    assert triton_attn._tile_limits(128, 4) == (16, 32)
    assert triton_attn._tile_limits(256, 2) == (16, 32)
    assert triton_attn._tile_limits(256, 4) == (16, 16)
    assert [triton_attn._num_warps(m, 128) for m in (16, 32, 64)] == [4, 4, 8]

    class Properties:
        multi_processor_count = 132
        gpu_subslice_count = 64

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties)
    monkeypatch.setattr(
        torch, "xpu", type("xpu", (), {"get_device_properties": staticmethod(lambda i: Properties)})
    )
    triton_attn._device_compute_units.cache_clear()
    try:
        assert triton_attn._compute_units(torch.device("cuda", 0)) == 132
        assert triton_attn._compute_units(torch.device("xpu")) == 64
        assert triton_attn._compute_units(torch.device("cpu")) == triton_attn.INTERPRETER_COMPUTE_UNITS
    finally:
        triton_attn._device_compute_units.cache_clear()


def _compile_for_cuda(fn, types: dict, constants: dict, num_warps: int):
    """`fn` compiled ahead of time for sm_90 by Triton's own compiler and ptxas, which need no GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = JITFunction(fn)
    signature = {
        name: types.get(name, "constexpr" if name in constants else "i32") for name in kernel.arg_names
    }
    source = ASTSource(kernel, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


@pytest.mark.parametrize(
    "dtype, head_size, block_m, splits, window, soft_cap, sinks",
    [
        ("bf16", 128, 16, 8, 4096, 0.0, False),
        ("bf16", 128, 64, 1, 0, 0.0, False),
        pytest.param("fp32", 256, 16, 1, 0, 0.0, False, marks=pytest.mark.slow),
        ("bf16", 64, 16, 4, 128, 30.0, True),
        pytest.param("bf16", 256, 32, 1, 0, 50.0, False, marks=pytest.mark.slow),
    ],
    ids=[
        "decode-split-k-bf16-128",
        "prefill-bf16-128",
        "prefill-fp32-256",
        "decode-split-k-bf16-64-soft_cap-sinks",
        "prefill-bf16-256-soft_cap",
    ],
)
def test_kernels_compile_for_cuda(
    monkeypatch, tmp_path, dtype, head_size, block_m, splits, window, soft_cap, sinks
):
    """The compiled path, which the interpreter does not take: both kernels build for sm_90, the largest
    tiles for their head size and dtype within 64 KiB of shared memory, with soft-cap and sinks too."""
    pytest.importorskip("triton.backends.nvidia")
    import triton.language as tl

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    element = {"bf16": "*bf16", "fp32": "*fp32"}[dtype]
    dot_dtype = {"bf16": tl.bfloat16, "fp32": tl.float32}[dtype]
    block_n, max_block_m = triton_attn._tile_limits(head_size, dot_dtype.primitive_bitwidth // 8)
    assert block_m <= max_block_m
    pointers = ["out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr"]
    types = {name: element for name in pointers} | {"partial_ml_ptr": "*fp32", "partial_out_ptr": "*fp32"}
    types |= {name: "*i32" for name in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr")}
    types |= {"tile_reqs_ptr": "*i32", "tile_firsts_ptr": "*i32", "scale": "fp32", "sinks_ptr": "*fp32"}
    constants = dict(
        GROUP=4, NUM_HEADS=8, HEAD_SIZE=head_size, HEAD_PAD=head_size, BLOCK_SIZE=16, BLOCK_M=block_m,
        BLOCK_N=block_n, NUM_SPLITS=splits, SLIDING_WINDOW=window, SOFT_CAP=soft_cap, HAS_SINKS=sinks,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dtype == "fp32" else None,
    )  # fmt: skip
    attention = _compile_for_cuda(
        triton_attn._paged_attention, types, constants, triton_attn._num_warps(block_m, head_size)
    )
    assert attention.metadata.shared <= 64 * 1024
    merge = {"NUM_HEADS": 8, "HEAD_SIZE": head_size, "HEAD_PAD": head_size, "NUM_SPLITS": splits}
    merge_types = {"out_ptr": element, "partial_ml_ptr": "*fp32", "partial_out_ptr": "*fp32"}
    assert _compile_for_cuda(triton_attn._merge_splits, merge_types, merge, 4).asm["cubin"]
