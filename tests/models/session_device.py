"""The torch device the test session's engines run on, for the references they are compared with."""

from __future__ import annotations

import functools
import os

import torch

from pagellm.core.selector import select_platform
from pagellm.plugins import load_plugins


def session_device() -> torch.device:
    """The device of the platform PAGELLM_DEVICE names (tests/conftest.py sets it: `--device`, default cpu),
    chosen as `LLM()` chooses it, so a transformers reference runs where the engine under test runs."""
    return _platform_device(os.environ.get("PAGELLM_DEVICE"))


@functools.cache
def _platform_device(name: str | None) -> torch.device:
    return select_platform(load_plugins(), name).platform.device()
