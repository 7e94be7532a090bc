"""No file of pagellm imports itself through others: the module-level import graph has no circles.

A circle makes the files' import order matter and neither file can be read, tested or moved without the
other. Every import statement counts: at module level, inside a function (a lazy import that keeps a
circle alive is still a circle) and under `if TYPE_CHECKING:`. The graph is grimp's, the one import-linter
checks the layers of pyproject.toml with; a circle is a strongly connected component of two or more
modules, reported with one shortest cycle through it and the lines that make it.

`python tests/test_import_cycles.py [PROJECT]` prints the circles of PROJECT/pagellm (default: this
checkout) and exits 1 when there is one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import deque
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of `graph` (module -> the modules it imports) with two or more modules, each
    sorted, in order of their first module; iterative, so a long chain of imports cannot overflow."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for succ in edges:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """The shortest cycle through the component's first module, as [m0, m1, ..., m0]."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in sorted(graph[node] & members):
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if succ not in came_from:
                came_from[succ] = node
                queue.append(succ)
    raise AssertionError(f"{component} is not strongly connected")


def find_cycles(package: str = "pagellm") -> list[dict]:
    """The circles of `package` as importable here: for each, its modules and one cycle's imports (each
    importer, imported, and the importer's line numbers and lines that import it)."""
    import grimp

    graph = grimp.build_graph(package, cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    result = []
    for component in strongly_connected(edges):
        cycle = shortest_cycle(edges, component)
        imports = []
        for importer, imported in pairwise(cycle):
            details = graph.get_import_details(importer=importer, imported=imported)
            lines = sorted({(d["line_number"], d["line_contents"]) for d in details})
            imports.append({"importer": importer, "imported": imported, "lines": lines})
        result.append({"modules": component, "cycle": imports})
    return result


def format_cycles(cycles: list[dict]) -> str:
    out = []
    for c in cycles:
        out.append(f"circle of {len(c['modules'])} modules: {', '.join(c['modules'])}")
        for step in c["cycle"]:
            where = "; ".join(f"line {n}: {text}" for n, text in step["lines"])
            out.append(f"  {step['importer']} -> {step['imported']} ({where})")
    return "\n".join(out)


def import_cycles(project: Path) -> list[dict]:
    """`find_cycles` for the pagellm package in `project`, in a fresh interpreter (so that it is that
    package grimp reads, not the one this process imported)."""
    env = {**os.environ, "PYTHONPATH": str(project)}
    result = subprocess.run(
        [sys.executable, __file__, str(project), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def present() -> list[dict]:
    return import_cycles(ROOT)


def test_no_file_imports_itself_through_others(present):
    cycles = present
    assert not cycles, "import circles between files of pagellm:\n" + format_cycles(cycles)


def _add(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


@pytest.mark.parametrize(
    "injections, circle",
    [
        # at module level, closing a circle with an import that already exists (selector -> registry)
        (
            {"core/registry.py": "\nimport pagellm.core.selector\n"},
            ["pagellm.core.registry", "pagellm.core.selector"],
        ),
        # inside a function: a lazy import is still a circle (layers.attention -> context)
        (
            {
                "models/context.py": "\n\ndef _layers():\n    from pagellm.models.layers.attention import Attention\n"
            },
            ["pagellm.models.context", "pagellm.models.layers.attention"],
        ),
        # under TYPE_CHECKING (layers.linear -> context)
        (
            {
                "models/context.py": "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                "    from pagellm.models.layers.linear import Linear\n"
            },
            ["pagellm.models.context", "pagellm.models.layers.linear"],
        ),
        # two new imports, across subpackages
        (
            {
                "core/paths.py": "\nimport pagellm.sampling.sampler\n",
                "sampling/sampler.py": "\nimport pagellm.core.paths\n",
            },
            ["pagellm.core.paths", "pagellm.sampling.sampler"],
        ),
    ],
)
def test_an_injected_circle_is_reported(tmp_path, present, injections, circle):
    shutil.copytree(ROOT / "pagellm", tmp_path / "pagellm", ignore=shutil.ignore_patterns("__pycache__"))
    before = {tuple(c["modules"]) for c in present}
    for module, text in injections.items():
        _add(tmp_path / "pagellm" / module, text)
    cycles = import_cycles(tmp_path)
    new = [c for c in cycles if tuple(c["modules"]) not in before]
    assert [c["modules"] for c in new] == [circle], format_cycles(cycles)
    report = format_cycles(new)
    for importer, imported in pairwise([*circle, circle[0]]):
        assert f"{importer} -> {imported}" in report, report
    for text in injections.values():  # the report names the lines that close the circle
        assert text.strip().splitlines()[-1].strip() in report, report


def test_strongly_connected_and_shortest_cycle():
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"a", "d"}, "e": set()}
    assert strongly_connected(graph) == [["a", "b", "c"]]  # d's self-import is not a circle of files
    assert shortest_cycle(graph, ["a", "b", "c"]) == ["a", "b", "a"]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] != "--json":
        sys.path.insert(0, sys.argv[1])
    found = find_cycles()
    print(json.dumps(found) if "--json" in sys.argv else format_cycles(found) or "no import circles")
    sys.exit(1 if found else 0)
