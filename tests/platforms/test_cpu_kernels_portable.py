"""The kernels' plain C++ paths (what a CPU without AVX2 runs) and their AVX2 paths (what AMD Zen 2/3 and
older Intel CPUs run) pass the GGUF kernel tests (linears and experts), the native decode step's GGUF
tests and sparse attention's: the library built with PAGELLM_CPU_KERNELS_ARCH=x86-64 or haswell, in a
process of its own (one build of the kernels each: slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow
@pytest.mark.parametrize("arch, isa", [("x86-64", "scalar"), ("haswell", "avx2")])
def test_gguf_kernels_on_a_portable_build(tmp_path, arch, isa):
    env = {**os.environ, "PAGELLM_CPU_KERNELS_ARCH": arch, "PAGELLM_CACHE_DIR": str(tmp_path)}
    built = subprocess.run(
        [sys.executable, "-c", "from pagellm.platforms import cpu_kernels; print(cpu_kernels.load().isa())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert built.stdout.strip() == isa
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            str(HERE / "test_cpu_gguf.py"),
            str(HERE / "test_cpu_gguf_moe.py"),
            str(HERE / "test_cpu_sparse_attention.py"),
            str(HERE.parent / "worker" / "test_native_decode.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
