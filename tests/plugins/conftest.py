"""Install the example vendor package (examples/plugins/) into this interpreter, as a vendor's user would.

Installing takes seconds, so the vendor package is installed once and kept (later sessions reuse it while
its sources are unchanged); the broken copy lives only for the module that asks for it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import importlib_metadata
import pytest

from pagellm.plugins import reset_plugins

VENDOR_SRC = Path(__file__).parents[2] / "examples" / "plugins" / "pagellm-vendor-example"
VENDOR_DIST = "pagellm-vendor-example"
VENDOR_PACKAGE = "pagellm_vendor_example"
BROKEN_DIST = "pagellm-vendor-broken"
BROKEN_PLUGIN = "vendor_broken"
BROKEN_ERROR = "libvendor_runtime.so.3: cannot open shared object file"


def pip(*args: str) -> None:
    quiet = ("-q", "--disable-pip-version-check", "--root-user-action=ignore")
    subprocess.run([sys.executable, "-m", "pip", *args, *quiet], check=True)


def install_copy(src: Path, workdir: Path) -> None:
    """pip-install a copy of `src`, so the in-tree build leaves nothing behind in the shared checkout."""
    copy = workdir / src.name
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pip("install", "--no-deps", "--no-build-isolation", str(copy))


def _installed_is_current() -> bool:
    """The vendor package is installed and its modules match the sources (else it is reinstalled)."""
    try:
        dist = importlib_metadata.distribution(VENDOR_DIST)
    except importlib_metadata.PackageNotFoundError:
        return False
    installed = {f.name: f for f in dist.files or [] if f.parent.name == VENDOR_PACKAGE and f.suffix == ".py"}
    sources = {p.name: p for p in (VENDOR_SRC / VENDOR_PACKAGE).glob("*.py")}
    return installed.keys() == sources.keys() and all(
        Path(dist.locate_file(installed[name])).read_bytes() == path.read_bytes()
        for name, path in sources.items()
    )


@pytest.fixture(scope="session")
def vendor_plugin(tmp_path_factory: pytest.TempPathFactory) -> importlib_metadata.Distribution:
    """The vendor package, installed; plugin caches are reset so the next load_plugins() sees it."""
    if not _installed_is_current():
        install_copy(VENDOR_SRC, tmp_path_factory.mktemp("vendor"))
    reset_plugins()
    yield importlib_metadata.distribution(VENDOR_DIST)
    reset_plugins()


@pytest.fixture(scope="module")
def broken_plugin(vendor_plugin, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A second copy of the vendor package, under another distribution and entry point name, whose plugin
    module raises ImportError (a vendor runtime library missing). Uninstalled at teardown.

    Yields its entry point `name`, distribution `dist` and the `error` its import raises."""
    root = tmp_path_factory.mktemp("broken") / BROKEN_DIST
    package = root / "pagellm_vendor_broken"
    shutil.copytree(VENDOR_SRC / VENDOR_PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    plugin = package / "plugin.py"
    future = "from __future__ import annotations\n"
    plugin.write_text(plugin.read_text().replace(future, f"{future}\nraise ImportError({BROKEN_ERROR!r})\n"))
    pyproject = (VENDOR_SRC / "pyproject.toml").read_text()
    pyproject = pyproject.replace(VENDOR_DIST, BROKEN_DIST).replace(VENDOR_PACKAGE, "pagellm_vendor_broken")
    (root / "pyproject.toml").write_text(pyproject.replace("vendor_example =", f"{BROKEN_PLUGIN} ="))
    pip("install", "--no-deps", "--no-build-isolation", str(root))
    reset_plugins()
    try:
        yield SimpleNamespace(name=BROKEN_PLUGIN, dist=BROKEN_DIST, error=BROKEN_ERROR)
    finally:
        pip("uninstall", "-y", BROKEN_DIST)
        reset_plugins()
