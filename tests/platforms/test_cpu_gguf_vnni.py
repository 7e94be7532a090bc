"""The GGUF kernels' byte products on VNNI (`add_byte_products` in cpu_kernels/gguf_blocks.h) and AMX's int8
tiles (cpu_kernels/gguf_amx.h): a CPU with AVX-512 VNNI (and VL) or AVX-VNNI takes vpdpbusd, one with AMX
multiplies five or more x rows on its tiles, and both give the same integers, so the same results bit for
bit, as the AVX2 maddubs path, which the same library built for Haswell (AVX2, no VNNI, no AMX) runs here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagellm.platforms import cpu_gguf, cpu_kernels
from pagellm.platforms.cpu import _cpu_flags

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="the native CPU kernels are not built here")

FLAGS = _cpu_flags()
VNNI = {"avx512_vnni", "avx512vl"} <= FLAGS or "avx_vnni" in FLAGS
AMX = {"amx_int8", "amx_tile", "avx512f"} <= FLAGS
TYPES = [
    *(T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K),
    *(T.IQ4_NL, T.IQ4_XS, T.MXFP4),
]

# Prints the products of every type and layout at one row (straight from the blocks), three (the same, three
# rows), eleven (the int8 tiles: one AMX tile, five rows of it empty) and forty (three AMX tiles, the last
# part empty) as one saved dict, and three experts kernels' outputs, and the build's path, in the process it runs in.
PRODUCTS = """
import sys, torch
sys.path.insert(0, {quant!r})
from quant_formats import random_blocks
from gguf import GGMLQuantizationType as T
from pagellm.platforms import cpu_gguf, cpu_gguf_moe, cpu_kernels
out = {{}}
for name in {types!r}:
    t = T[name]
    raw = torch.from_numpy(random_blocks(t, 37, 1024, seed=int(t)))
    layouts = [(raw, int(t))]
    if cpu_kernels.load().gguf_interleaved_type(int(t)) >= 0:
        layouts.append(cpu_gguf.interleave(raw, int(t)))
    for weight, type_id in layouts:
        for rows in (1, 3, 11, 40):
            x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows)).bfloat16()
            out[(type_id, rows)] = cpu_gguf.linear(x, [weight], [type_id])
# experts: 48 tokens, top 2 of 4 (about 24 rows an expert: AMX's tiles where they run)
gen = torch.Generator().manual_seed(7)
ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(48)])
weights = torch.rand(48, 2, generator=gen)
hidden = torch.randn(48, 256, generator=gen).bfloat16()
for name in ("Q4_K", "Q6_K", "Q8_0"):
    t = T[name]
    gate, up = (torch.from_numpy(random_blocks(t, 4 * 512, 256, seed=s)).view(4, 512, -1) for s in (1, 2))
    down = torch.from_numpy(random_blocks(t, 4 * 256, 512, seed=3)).view(4, 256, -1)
    experts = cpu_gguf_moe.pack(gate, up, down, [int(t)] * 3, "silu", name).run
    out[("moe", int(t))] = experts(hidden, weights, ids)
torch.save(out, sys.argv[1])
print(cpu_kernels.load().gguf_isa())
"""


def products(env: dict[str, str], path: Path) -> tuple[str, dict]:
    script = PRODUCTS.format(
        quant=str(Path(__file__).parents[1] / "quantization"), types=[t.name for t in TYPES]
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1], torch.load(path)


NATIVE_ISA = ("amx-int8+" if AMX else "") + ("avx2+vnni" if VNNI else "avx2")


def test_the_gguf_kernels_take_vnni_and_amx_where_the_cpu_has_them():
    isa = cpu_kernels.load().gguf_isa()
    if cpu_kernels.load().isa() == "scalar":
        assert isa == "scalar"
    else:
        assert isa == NATIVE_ISA


@pytest.mark.slow
@pytest.mark.skipif(not VNNI, reason="no VNNI on this CPU: the native build is the AVX2 path already")
def test_vnni_and_amx_products_equal_the_avx2_paths_bit_for_bit(tmp_path):
    native_isa, native = products(dict(os.environ), tmp_path / "n.pt")
    haswell = {
        **os.environ,
        cpu_kernels.ARCH_SWITCH: "haswell",
        "PAGELLM_CACHE_DIR": str(tmp_path / "haswell"),
    }
    avx2_isa, avx2 = products(haswell, tmp_path / "h.pt")
    assert (native_isa, avx2_isa) == (NATIVE_ISA, "avx2")
    assert native.keys() == avx2.keys() and len(native) == (len(TYPES) + 7) * 4 + 3
    for case, got in native.items():
        assert torch.equal(got.view(torch.int16), avx2[case].view(torch.int16)), case
