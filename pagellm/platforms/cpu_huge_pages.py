"""Weights on 2 MiB pages: a tensor's memory mapped for the kernel's transparent huge pages.

A decode step streams every weight once; with 4 KiB pages that is a TLB miss every 64 cache lines, and
llama.cpp's weights, mapped from the GGUF file, sit on ext4's large folios (2 MiB page-table entries for
690 of model M's 988 MB, `FilePmdMapped`). An anonymous mapping asked for huge pages (`MADV_HUGEPAGE`,
honoured where /sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`) before it is written
gets them as it is filled, with no copy afterwards."""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor on its own anonymous mapping asked for huge pages; torch.empty where it is
    smaller than one huge page or the platform has no MADV_HUGEPAGE (the tensor keeps the mapping alive)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if _MADV_HUGEPAGE is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.madvise(_MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as torch.empty's
        pass
    return torch.frombuffer(memory, dtype=dtype).view(shape)
