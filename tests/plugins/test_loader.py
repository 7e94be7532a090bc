"""Loader rules of docs/architecture.md ("Writing a plugin"), on fake plugins: modules and dist-info
folders written into tmp_path (the `fake` fixture of conftest.py)."""

from __future__ import annotations

import logging
import sys

import pytest

from pagellm.core.errors import PluginError
from pagellm.plugins import load_plugins, loader, reset_plugins


def platform_hook(platform: str) -> str:
    """Plugin source registering a platform named `platform`."""
    return f"""
        class P(Platform):
            name, device_type = {platform!r}, "cpu"

            @classmethod
            def availability(cls):
                return Availability.yes("fake")

        @hookimpl
        def pagellm_platforms():
            return [P]
        """


def test_plugins_load_by_descending_priority_then_name(fake):
    for name in ["b", "a", "d"]:
        fake.add(name, platform_hook(f"p_{name}"))
    fake.add("c", platform_hook("p_c"), priority=5)
    fake.add("e", platform_hook("p_e"), priority=-1)
    registry = load_plugins()
    assert list(registry.platforms) == ["p_c", "p_a", "p_b", "p_d", "p_e"]
    assert [(p.name, p.loaded) for p in registry.plugins] == [(n, True) for n in "abcde"]
    assert registry.owner("platforms", "p_a") == "fake-a 1.2 (plugin 'a')"


@pytest.mark.parametrize("api", [None, "2.0", "1.9"])
def test_incompatible_api_version_is_refused(fake, monkeypatch, caplog, api):
    fake.add("old", platform_hook("p_old"), api=api, dist="vendor-old")
    fake.add("good", platform_hook("p_good"))
    with caplog.at_level(logging.WARNING, logger="pagellm.plugins"):
        registry = load_plugins()
    assert list(registry.platforms) == ["p_good"]
    info = next(p for p in registry.plugins if p.name == "old")
    assert not info.loaded and info.error
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    expected = ["'old'", "vendor-old", api or "PAGELLM_PLUGIN_API", loader.API_VERSION]
    assert all(part in warning.getMessage() for part in expected), warning.getMessage()

    monkeypatch.setenv("PAGELLM_PLUGINS", "old,good")
    with pytest.raises(PluginError) as error:
        load_plugins()
    assert all(part in str(error.value) for part in expected), error.value


@pytest.mark.parametrize("api", ["1.0", "1"])
def test_compatible_api_version_loads(fake, api):
    fake.add("current", platform_hook("p_current"), api=api)
    assert list(load_plugins().platforms) == ["p_current"]


def test_name_registered_twice_names_both_distributions(fake):
    fake.add("first", platform_hook("dup"), dist="vendor-a")
    fake.add("second", platform_hook("dup"), dist="vendor-b")
    with pytest.raises(
        PluginError, match=r"'dup' is registered twice: by vendor-a 1\.2 .* and by vendor-b 1\.2"
    ):
        load_plugins()


def test_hook_that_raises_is_skipped_with_a_warning(fake, monkeypatch, caplog):
    fake.add(
        "flaky",
        """
        class Q:
            name = "flaky_q"

        @hookimpl
        def pagellm_platforms():
            raise RuntimeError("device table corrupt")

        @hookimpl
        def pagellm_quant_methods():
            return [Q]
        """,
    )
    fake.add("good", platform_hook("p_good"))
    with caplog.at_level(logging.WARNING, logger="pagellm.plugins"):
        registry = load_plugins()
    assert list(registry.platforms) == ["p_good"] and list(registry.quant_methods) == ["flaky_q"]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "'flaky'" in warning and "pagellm_platforms" in warning and "device table corrupt" in warning

    monkeypatch.setenv("PAGELLM_PLUGINS", "flaky,good")
    with pytest.raises(PluginError, match="'flaky' hook pagellm_platforms raised.*device table corrupt"):
        load_plugins()


def test_unknown_name_in_allow_list_lists_the_installed_plugins(fake, monkeypatch):
    fake.add("a", platform_hook("p_a"))
    fake.add("b", platform_hook("p_b"))
    monkeypatch.setenv("PAGELLM_PLUGINS", "a, nope")
    with pytest.raises(PluginError, match="PAGELLM_PLUGINS names nope.*installed plugins: a, b"):
        load_plugins()


def test_allow_list_loads_only_the_named_plugins(fake, monkeypatch):
    fake.add("a", platform_hook("p_a"))
    fake.add("b", platform_hook("p_b"))
    monkeypatch.setenv("PAGELLM_PLUGINS", "b")
    registry = load_plugins()
    assert list(registry.platforms) == ["p_b"]
    assert [(p.name, p.loaded, p.error) for p in registry.plugins] == [
        ("a", False, "left out by PAGELLM_PLUGINS"),
        ("b", True, None),
    ]


def test_plugins_load_once_per_process(fake):
    module = fake.add(
        "counted",
        """
        CALLS = []

        @hookimpl
        def pagellm_models():
            CALLS.append(1)
            return {"CountedForCausalLM": "counted:Model"}
        """,
    )
    first = load_plugins()
    assert load_plugins() is first
    assert fake.entry_points_calls == 1 and len(sys.modules[module].CALLS) == 1
    assert first.models == {"CountedForCausalLM": "counted:Model"}

    reset_plugins()
    assert load_plugins() is not first
    assert fake.entry_points_calls == 2 and len(sys.modules[module].CALLS) == 2


def test_renamed_hook_keeps_working_with_a_deprecation_warning(fake, monkeypatch):
    monkeypatch.setattr(loader, "DEPRECATED_HOOKS", {"pagellm_old_platforms": "pagellm_platforms"})
    legacy = platform_hook("p_legacy").replace("def pagellm_platforms", "def pagellm_old_platforms")
    fake.add("legacy", legacy)
    with pytest.warns(DeprecationWarning, match="'legacy'.*'pagellm_old_platforms'.*'pagellm_platforms'"):
        registry = load_plugins()
    assert list(registry.platforms) == ["p_legacy"]


def test_a_misspelled_hook_skips_only_that_plugin(fake, caplog):
    fake.add("typo", "@hookimpl\ndef pagellm_platfroms():\n    return []\n")
    fake.add("good", platform_hook("good"))
    with caplog.at_level(logging.WARNING, logger="pagellm.plugins"):
        registry = load_plugins()
    assert "good" in registry.platforms
    assert "unknown hook(s) pagellm_platfroms" in caplog.text
    assert not next(p for p in registry.plugins if p.name == "typo").loaded
