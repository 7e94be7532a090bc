"""Where pagellm keeps what it computes once: timings, converted checkpoints, compiled kernels."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """PAGELLM_CACHE_DIR, or pagellm/ under XDG_CACHE_HOME (default ~/.cache)."""
    return os.environ.get("PAGELLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagellm"
    )


def keep_compiled_code_in_cache_dir() -> None:
    """Point inductor's cache (TORCHINDUCTOR_CACHE_DIR, unless the user set it) at
    `cache_dir()/inductor/<ops key>`, the key a hash of pagellm's custom operator schemas (`op_schemas_key`).

    Called before anything compiles and after the plugins load (they define the operators). Inductor fixes
    its folder at its first compile by writing its default (/tmp/torchinductor_<user>) into the environment;
    when that first compile was the attention backends' timing (flex attention) the model's graphs went
    there, and the next start, whose timings came from the cache, looked for them in pagellm's folder and
    compiled them all again. The key: inductor's own cache keys do not cover an operator's schema, so after
    an upgrade that adds an argument to one, a graph compiled before called it with the old arguments (its
    C++ wrapper crashed the process). A value equal to inductor's own default was written by inductor (some
    torch imports do it), not by the user, and is replaced too. Inductor is imported only to learn its default
    when the variable is set (importing it costs a second or two of a start that may never compile)."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is not None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if current != default_cache_dir():
            return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir(), "inductor", op_schemas_key())


def op_schemas_key() -> str:
    """12 hex digits of a hash of every `pagellm::` operator schema defined now."""
    import hashlib

    import torch

    schemas = sorted(str(s) for s in torch._C._jit_get_all_schemas() if str(s).startswith("pagellm::"))
    return hashlib.sha256("\n".join(schemas).encode()).hexdigest()[:12]
