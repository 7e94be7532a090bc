"""Where pagellm keeps what it computes once: timings, converted checkpoints, compiled kernels."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """PAGELLM_CACHE_DIR, or pagellm/ under XDG_CACHE_HOME (default ~/.cache)."""
    return os.environ.get("PAGELLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagellm"
    )


def keep_compiled_code_in_cache_dir() -> None:
    """Point inductor's cache (TORCHINDUCTOR_CACHE_DIR, unless the user set it) at `cache_dir()/inductor`.

    Called before anything compiles. Inductor fixes its folder at its first compile by writing its default
    (/tmp/torchinductor_<user>) into the environment; when that first compile was the attention backends'
    timing (flex attention) the model's graphs went there, and the next start, whose timings came from the
    cache, looked for them in pagellm's folder and compiled them all again."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir(), "inductor"))
