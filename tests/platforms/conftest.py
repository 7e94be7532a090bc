"""What the platform tests share: the native CPU kernels, built once per session (skipped where none
can be built)."""

from __future__ import annotations

import pytest

from pagellm.platforms import cpu_kernels


@pytest.fixture(scope="session")
def kernels():
    module = cpu_kernels.load()
    if module is None:
        pytest.skip(f"no native kernels here: {cpu_kernels.why_unavailable()}")
    return module
