"""Each tensor-parallel layer on 2 gloo ranks equals its dense reference (float32)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("layers_on_ranks.py")


@pytest.mark.timeout(120)
def test_parallel_layers_equal_their_dense_reference_on_two_ranks(tmp_path):
    world = 2
    ranks = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(rank), str(world), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = [p.communicate(timeout=100)[0] for p in ranks]
    for rank, (process, output) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 0 and f"OK {rank}" in output, output
