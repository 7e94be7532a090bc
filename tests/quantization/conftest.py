"""Fixtures of the quantization tests."""

import pytest


@pytest.fixture
def fresh_kernels():
    """The Triton GEMMs (AWQ/GPTQ's and GGUF's) jitted anew for the test, which changes their tile configs,
    and again after it."""
    pytest.importorskip("triton")
    from pagellm.quantization import gguf_triton, packed_triton

    caches = (packed_triton._kernel_in_mode, gguf_triton._kernel_in_mode)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()
