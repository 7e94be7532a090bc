"""Packed weights on 2 MiB pages (`cpu_huge_pages.huge_page_empty`): the same values, on huge pages where the
kernel gives them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pagellm.platforms.cpu_huge_pages import HUGE_PAGE, huge_page_empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kb_of(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds `tensor`'s first byte (/proc/self/smaps)."""
    address, found = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            found = int(span[1], 16) <= address < int(span[2], 16)
        elif found and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_small_tensors_are_plain_and_large_ones_hold_what_is_written():
    small = huge_page_empty((16, 16), torch.bfloat16)
    assert small.shape == (16, 16) and small.dtype == torch.bfloat16
    values = torch.randn(4096, 1024, dtype=torch.bfloat16)  # 8 MiB
    large = huge_page_empty(tuple(values.shape), values.dtype).copy_(values)
    assert torch.equal(large, values) and large.is_contiguous()


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="the kernel gives no transparent huge pages"
)
def test_a_large_tensor_sits_on_huge_pages():
    tensor = huge_page_empty((4 * HUGE_PAGE // 2,), torch.bfloat16)  # 8 MiB
    tensor.fill_(1)
    assert _huge_kb_of(tensor) >= 2048, "no 2 MiB page in the tensor's mapping"


def test_packed_pairs_equal_the_plain_layout():
    from pagellm.platforms import cpu_kernels
    from pagellm.platforms.cpu_linear import pack_pairs

    if cpu_kernels.load() is None:
        pytest.skip("no CPU kernels here")
    weight = torch.randn(2048 + 5, 1030, dtype=torch.bfloat16)  # past 2 MiB, odd in both directions
    padded = torch.nn.functional.pad(weight, (0, 0, 0, 11))  # out to whole panels of 16
    expected = padded.view(-1, 16, 515, 2).transpose(1, 2)  # [panels, pairs, 16, 2]
    assert torch.equal(pack_pairs(weight).weight, expected)
