"""docs/architecture.md is where the code's own docs point: it exists, names every subpackage in its layer
map, and is what code comments cite; every plugin hook says when it is called and what to return."""

from __future__ import annotations

import inspect
import pkgutil
import re
from pathlib import Path

import pagellm
from pagellm.plugins import hookspecs

ROOT = Path(__file__).parents[1]
DOC = ROOT / "docs" / "architecture.md"


def test_the_layer_map_names_every_subpackage():
    layers = DOC.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"[a-z_]+", layers))
    subpackages = {m.name for m in pkgutil.iter_modules(pagellm.__path__) if m.ispkg}
    assert subpackages <= named, f"not in the layer map: {sorted(subpackages - named)}"


def test_code_cites_docs_architecture_not_the_plan():
    citing = [
        str(path.relative_to(ROOT))
        for folder in ("pagellm", "tests", "examples")
        for path in (ROOT / folder).rglob("*.py")
        if path != Path(__file__) and "DESIGN.md" in path.read_text()
    ]
    assert citing == []


def test_every_hookspec_says_when_it_is_called_and_what_to_return():
    specs = [
        f for name, f in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("pagellm_")
    ]
    assert len(specs) == 8
    for spec in specs:
        doc = inspect.getdoc(spec)
        assert "Called when" in doc and ":returns:" in doc, spec.__name__
