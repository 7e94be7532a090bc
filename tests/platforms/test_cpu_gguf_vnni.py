"""The GGUF kernels' byte products on VNNI (`add_byte_products` in cpu_kernels/gguf_blocks.h): a CPU with
AVX-512 VNNI (and VL) or AVX-VNNI takes vpdpbusd, and it gives the same integers, so the same results bit for
bit, as the AVX2 maddubs path, which the same library built for Haswell (AVX2, no VNNI) runs here."""

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
TYPES = [
    *(T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K),
    *(T.IQ4_NL, T.IQ4_XS, T.MXFP4),
]

# Prints the products of every type and layout at one row (straight from the blocks), three (the same, three
# rows) and eleven (the int8 tiles) as one saved dict, and the build's path, in the process it runs in.
PRODUCTS = """
import sys, torch
sys.path.insert(0, {quant!r})
from quant_formats import random_blocks
from gguf import GGMLQuantizationType as T
from pagellm.platforms import cpu_gguf, cpu_kernels
out = {{}}
for name in {types!r}:
    t = T[name]
    raw = torch.from_numpy(random_blocks(t, 37, 1024, seed=int(t)))
    layouts = [(raw, int(t))]
    if cpu_kernels.load().gguf_interleaved_type(int(t)) >= 0:
        layouts.append(cpu_gguf.interleave(raw, int(t)))
    for weight, type_id in layouts:
        for rows in (1, 3, 11):
            x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows)).bfloat16()
            out[(type_id, rows)] = cpu_gguf.linear(x, [weight], [type_id])
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


def test_the_gguf_kernels_take_vnni_where_the_cpu_has_it():
    isa = cpu_kernels.load().gguf_isa()
    if cpu_kernels.load().isa() == "scalar":
        assert isa == "scalar"
    else:
        assert isa == ("avx2+vnni" if VNNI else "avx2")


@pytest.mark.slow
@pytest.mark.skipif(not VNNI, reason="no VNNI on this CPU: the native build is the AVX2 path already")
def test_vnni_products_equal_the_avx2_paths_bit_for_bit(tmp_path):
    native_isa, native = products(dict(os.environ), tmp_path / "n.pt")
    haswell = {
        **os.environ,
        cpu_kernels.ARCH_SWITCH: "haswell",
        "PAGELLM_CACHE_DIR": str(tmp_path / "haswell"),
    }
    avx2_isa, avx2 = products(haswell, tmp_path / "h.pt")
    assert (native_isa, avx2_isa) == ("avx2+vnni", "avx2")
    assert native.keys() == avx2.keys() and len(native) == len(TYPES) * 3 + 7 * 3
    for case, got in native.items():
        assert torch.equal(got.view(torch.int16), avx2[case].view(torch.int16)), case
