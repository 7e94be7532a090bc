"""No function in pagellm/ longer than 80 lines (issue 48), Triton kernels aside.

A kernel is a function decorated with a `jit` (`@triton.jit`, `@jit`) or, as this code base jits its
kernels once per interpreter mode, one passed to a `jit` call in its module (`triton.jit(_paged_attention)`):
a kernel cannot call Python helpers, so it stays whole."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_LINES = 80
ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pagellm"

ALLOWED: set[str] = set()


def _names_jit(node: ast.expr) -> bool:
    """Whether a decorator or a callee names a jit: `triton.jit`, `jit`, `triton.jit(...)`."""
    if isinstance(node, ast.Call):
        node = node.func
    return "jit" in ast.unparse(node)


def _jitted_names(tree: ast.Module) -> set[str]:
    """Names the module passes to a jit call: its kernels, jitted where they are launched."""
    return {
        arg.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _names_jit(node.func)
        for arg in node.args
        if isinstance(arg, ast.Name)
    }


def long_functions(package: Path = PACKAGE) -> list[str]:
    """`path::name (lines)` of every function over MAX_LINES lines, kernels and ALLOWED aside."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        kernels = _jitted_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines <= MAX_LINES or node.name in kernels or any(map(_names_jit, node.decorator_list)):
                continue
            where = f"{path.relative_to(package.parent).as_posix()}::{node.name}"
            if where not in ALLOWED:
                found.append(f"{where} ({lines} lines)")
    return found


def test_no_function_over_80_lines():
    long = long_functions()
    assert not long, f"functions over {MAX_LINES} lines (split them into helpers, issue 48):\n" + "\n".join(
        long
    )


def test_allowed_functions_are_still_long():
    """An entry of ALLOWED whose function was split (or renamed) is dropped from the list."""
    lengths = {}
    for where in ALLOWED:
        path, name = where.split("::")
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        lengths[where] = max(
            (
                n.end_lineno - n.lineno + 1
                for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
            ),
            default=0,
        )
    assert all(n > MAX_LINES for n in lengths.values()), (
        f"no longer over {MAX_LINES} lines, drop from ALLOWED: "
        + ", ".join(w for w, n in lengths.items() if n <= MAX_LINES)
    )


def test_kernels_are_recognised(tmp_path):
    """Both ways a kernel is written, decorated and passed to `triton.jit` where it is launched, are let
    through; a plain function as long is not."""
    body = "    pass\n" * MAX_LINES
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(
        "import triton\n\n"
        f"@triton.jit\ndef decorated():\n{body}\n"
        f"def wrapped():\n{body}\n"
        "KERNEL = triton.jit(wrapped)\n\n"
        f"def plain():\n{body}"
    )
    assert long_functions(package) == [f"pkg/mod.py::plain ({MAX_LINES + 1} lines)"]
