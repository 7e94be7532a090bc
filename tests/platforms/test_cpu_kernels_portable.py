"""The kernels' plain C++ paths (what a CPU without AVX2 runs) pass the GGUF kernel tests (linears and
experts): the library built with PAGELLM_CPU_KERNELS_ARCH=x86-64, in a process of its own (one build of
the kernels: slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow
def test_gguf_kernels_without_avx2(tmp_path):
    env = {**os.environ, "PAGELLM_CPU_KERNELS_ARCH": "x86-64", "PAGELLM_CACHE_DIR": str(tmp_path)}
    isa = subprocess.run(
        [sys.executable, "-c", "from pagellm.platforms import cpu_kernels; print(cpu_kernels.load().isa())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert isa.stdout.strip() == "scalar"
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
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
