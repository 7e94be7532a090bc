"""Where pagellm keeps what it computes once: timings, converted checkpoints, compiled kernels."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """PAGELLM_CACHE_DIR, or pagellm/ under XDG_CACHE_HOME (default ~/.cache)."""
    return os.environ.get("PAGELLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagellm"
    )
