"""Plugins for the tests, registered through entry points as a vendor's would be.

`vendor_plugin` installs the example vendor package (examples/plugins/) into this interpreter, as a vendor's
user would. Installing takes seconds, so it is installed once and kept (later sessions reuse it while its
sources are unchanged); the broken copy lives only for the module that asks for it.

`fake` and `fake_beside_installed` write plugin modules and dist-info folders into tmp_path and show the
loader their entry points: alone, or next to the installed ones (pagellm's own, for an engine to run).
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import importlib_metadata
import pytest

from pagellm.plugins import loader, reset_plugins

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


_serial = itertools.count()


class FakePlugins:
    """Installs fake plugins for one test: `entry_points()` of the loader sees only these, or these and
    the installed ones (`keep_installed`)."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch, keep_installed: bool = False):
        self.root = root
        self.entry_points_calls = 0
        self.modules: list[str] = []
        self.dists: dict[str, list[str]] = {}
        self.installed = loader.importlib_metadata.entry_points if keep_installed else None
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.setattr(loader.importlib_metadata, "entry_points", self.entry_points)

    def add(
        self,
        name: str,
        source: str,
        api: str | None = "1.0",
        dist: str | None = None,
        priority: int | None = None,
    ) -> str:
        """Write a plugin module (header + `source`) and its entry point in `dist` (default: its own)."""
        module = f"fake_pagellm_plugin_{next(_serial)}_{name}"
        header = "from pagellm.core.platform import Availability, Platform\n"
        header += "from pagellm.plugins import hookimpl\n"
        if api is not None:
            header += f"PAGELLM_PLUGIN_API = {api!r}\n"
        if priority is not None:
            header += f"PAGELLM_PLUGIN_PRIORITY = {priority}\n"
        (self.root / f"{module}.py").write_text(header + textwrap.dedent(source))
        self.modules.append(module)
        dist = dist or f"fake-{name}"
        self.dists.setdefault(dist, []).append(f"{name} = {module}")
        info = self.root / f"{dist}-1.2.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2\n")
        (info / "entry_points.txt").write_text("[pagellm.plugins]\n" + "\n".join(self.dists[dist]) + "\n")
        return module

    def entry_points(self, **select: str) -> list[importlib_metadata.EntryPoint]:
        self.entry_points_calls += 1
        dists = [importlib_metadata.Distribution.at(self.root / f"{d}-1.2.dist-info") for d in self.dists]
        fakes = [ep for d in dists for ep in d.entry_points.select(**select)]
        return fakes if self.installed is None else [*self.installed(**select), *fakes]


def _fake_plugins(tmp_path, monkeypatch, keep_installed: bool):
    monkeypatch.delenv("PAGELLM_PLUGINS", raising=False)
    plugins = FakePlugins(tmp_path, monkeypatch, keep_installed)
    reset_plugins()
    yield plugins
    reset_plugins()
    for module in plugins.modules:
        sys.modules.pop(module, None)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Fake plugins, alone: the loader sees no installed entry point."""
    yield from _fake_plugins(tmp_path, monkeypatch, keep_installed=False)


@pytest.fixture
def fake_beside_installed(tmp_path, monkeypatch):
    """Fake plugins next to the installed ones (pagellm's platforms, backends and models)."""
    yield from _fake_plugins(tmp_path, monkeypatch, keep_installed=True)
