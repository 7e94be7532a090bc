"""The layers of docs/architecture.md hold: the import-linter contracts in pyproject.toml are kept, and
they do catch an import that points the wrong way."""

from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pagellm

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest's own dependency on Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).parents[1]
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which(
    "lint-imports"
)


def lint_imports(project: Path) -> subprocess.CompletedProcess:
    """Check the contracts of `project`/pyproject.toml against the pagellm package in `project`."""
    assert LINT_IMPORTS, "lint-imports not found: pip install import-linter (the test extra has it)"
    env = {**os.environ, "PYTHONPATH": str(project)}
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache"], cwd=project, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_contracts_are_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_core_is_forbidden_every_other_subpackage():
    """A new subpackage must be added to the contracts, or core could import it unnoticed."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    core = next(c for c in config["contracts"] if c["id"] == "core")
    subpackages = {f"pagellm.{m.name}" for m in pkgutil.iter_modules(pagellm.__path__) if m.ispkg}
    assert set(core["forbidden_modules"]) == subpackages - {"pagellm.core"}


@pytest.mark.parametrize(
    "module, bad_import, expected",
    [
        ("core/config.py", "pagellm.engine.llm", "core imports nothing else of pagellm BROKEN"),
        ("core/attention.py", "pagellm.plugins.loader", "core imports nothing else of pagellm BROKEN"),
        (
            "platforms/cpu.py",
            "pagellm.engine.setup",
            "pagellm.platforms is not allowed to import pagellm.engine",
        ),
        (
            "attention_backends/torch_sdpa.py",
            "pagellm.worker.model_runner",
            "pagellm.attention_backends is not allowed to import pagellm.worker",
        ),
        (
            "quantization/gguf.py",
            "pagellm.server.app",
            "pagellm.quantization is not allowed to import pagellm.server",
        ),
        ("engine/llm.py", "pagellm.server.app", "pagellm.engine is not allowed to import pagellm.server"),
        ("engine/llm.py", "pagellm.cli.main", "pagellm.engine is not allowed to import pagellm.cli"),
        (
            "worker/model_runner.py",
            "pagellm.engine.scheduler",
            "pagellm.worker is not allowed to import pagellm.engine",
        ),
    ],
)
def test_a_wrong_way_import_breaks_a_contract(tmp_path, module, bad_import, expected):
    shutil.copytree(ROOT / "pagellm", tmp_path / "pagellm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "pagellm" / module, "a") as f:
        f.write(f"\nimport {bad_import}\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert expected in " ".join(result.stdout.split()), result.stdout
