"""`triton.language` bound into a kernel module on first use.

Importing triton takes 0.15-0.3 s on two cores, which every CPU start paid for kernels it never runs
(the AWQ, GPTQ and GGUF quantization methods, the Triton attention backend and the MoE and recurrent kernels
are all imported when the plugins load). A module whose jitted kernels read `tl` from its globals starts
with `tl = None` and calls `bind_triton_language(globals())` where a kernel is about to be built or run.
Binding late also keeps triton's own `tl.zeros`-style jit functions callable by the interpreter when a
test sets `TRITON_INTERPRET` after the module was imported.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def bind_triton_language(namespace: dict[str, Any]) -> ModuleType | None:
    """`triton.language`, set as `tl` in `namespace` (a kernel module's globals()) if it is not there yet;
    None where triton is not installed."""
    if namespace.get("tl") is None:
        try:
            import triton.language as tl
        except ImportError:
            return None
        namespace["tl"] = tl
    return namespace["tl"]
