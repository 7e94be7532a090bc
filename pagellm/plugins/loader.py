"""Load the `pagellm.plugins` entry points into a `Registry`, once per process.

Rules (docs/architecture.md, "Writing a plugin"): `PAGELLM_PLUGINS=a,b` limits which plugins load; a
plugin that fails to import or declares an incompatible API version is logged at WARNING and skipped,
unless it was asked for by name, then loading fails; a name registered twice is an error naming both
distributions.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import warnings
from typing import Any

import importlib_metadata
import pluggy

from pagellm.core.errors import PluginError
from pagellm.core.parsers import ReasoningParser, ToolParser, check_parser
from pagellm.core.registry import PluginInfo, Registry
from pagellm.plugins import hookspecs

logger = logging.getLogger("pagellm.plugins")

ENTRY_POINT_GROUP = "pagellm.plugins"
API_VERSION = "1.3"
# 1.1: pagellm_reasoning_parsers, pagellm_tool_parsers; 1.2: pagellm_kv_connectors; 1.3: quantization methods
# declare `requires` and platforms `capabilities` (Platform.quantization_methods is no longer read)
"""Plugins declare the version they were written for; same major and a minor no newer than ours loads."""

DEPRECATED_HOOKS: dict[str, str] = {}
"""Old hook name -> current name. An old name keeps working, with a DeprecationWarning, for one release."""

_HOOK_TABLES = {
    "pagellm_platforms": "platforms",
    "pagellm_attention_backends": "attention_backends",
    "pagellm_quant_methods": "quant_methods",
    "pagellm_models": "models",
    "pagellm_reasoning_parsers": "reasoning_parsers",
    "pagellm_tool_parsers": "tool_parsers",
    "pagellm_kv_connectors": "kv_connectors",
}

_PARSER_KINDS = {"reasoning_parsers": ReasoningParser, "tool_parsers": ToolParser}
"""Tables of parser classes: each class a hook returns is checked to be one (`core.parsers.check_parser`)."""

_lock = threading.Lock()
_loaded: dict[str | None, Registry] = {}


def load_plugins() -> Registry:
    """The process's registry; loads the plugins on the first call (per PAGELLM_PLUGINS value)."""
    allow = os.environ.get("PAGELLM_PLUGINS")
    with _lock:
        if allow not in _loaded:
            _loaded[allow] = _load(_parse_allow_list(allow))
        return _loaded[allow]


def reset_plugins() -> None:
    """Forget loaded plugins (tests, or after installing a plugin at run time)."""
    with _lock:
        _loaded.clear()
    importlib.invalidate_caches()


def _parse_allow_list(value: str | None) -> list[str] | None:
    if value is None or not value.strip():
        return None
    return [n.strip() for n in value.split(",") if n.strip()]


def _load(allow: list[str] | None) -> Registry:
    registry = Registry()
    entry_points = sorted(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    found = {ep.name for ep in entry_points}
    if allow is not None:
        missing = [n for n in allow if n not in found]
        if missing:
            raise PluginError(
                f"PAGELLM_PLUGINS names {', '.join(missing)}, which no installed package provides; "
                f"installed plugins: {', '.join(sorted(found)) or 'none'}"
            )
    loaded: list[tuple[int, str, Any, PluginInfo]] = []
    for ep in entry_points:
        dist = ep.dist.name if ep.dist is not None else "?"
        version = ep.dist.version if ep.dist is not None else "?"
        info = PluginInfo(ep.name, dist, version, ep.value)
        registry.plugins.append(info)
        if allow is not None and ep.name not in allow:
            info.error = "left out by PAGELLM_PLUGINS"
            continue
        try:
            plugin = ep.load()
            _check_api_version(plugin, info)
        except Exception as exc:
            _skip_or_raise(info, "failed to load", exc, strict=allow is not None)
            continue
        loaded.append((-int(getattr(plugin, "PAGELLM_PLUGIN_PRIORITY", 0)), ep.name, plugin, info))
    loaded.sort(key=lambda item: item[:2])
    manager = _PluginManager("pagellm")
    manager.add_hookspecs(hookspecs)
    infos = {}
    for _, name, plugin, info in loaded:
        try:
            _warn_deprecated_hooks(plugin, info)
            _register(manager, plugin, info)
        except Exception as exc:
            _skip_or_raise(info, "is invalid", exc, strict=allow is not None)
            continue
        info.loaded = True
        infos[name] = info
    _fill(registry, manager, infos, strict=allow is not None)
    return registry


def _skip_or_raise(info: PluginInfo, problem: str, exc: Exception, strict: bool) -> None:
    """Record and log what went wrong with a plugin, which is then skipped; with `strict` (it was asked for
    in PAGELLM_PLUGINS) raise instead, since the user wants it and would otherwise run without it."""
    info.error = f"{problem}: {type(exc).__name__}: {exc}"
    message = (
        f"plugin {info.name!r} {problem} ({info.distribution} {info.version}): {type(exc).__name__}: {exc}"
    )
    if strict:
        raise PluginError(f"{message} (asked for in PAGELLM_PLUGINS)") from exc
    logger.warning("%s; skipped", message)


class _PluginManager(pluggy.PluginManager):
    """Maps deprecated hook names to their current spec, so old plugins keep working for one release."""

    def parse_hookimpl_opts(self, plugin, name):
        opts = super().parse_hookimpl_opts(plugin, name)
        new = DEPRECATED_HOOKS.get(name)
        if opts is None or new is None:
            return opts
        return None if hasattr(plugin, new) else {**opts, "specname": new}


def _register(manager: pluggy.PluginManager, plugin: Any, info: PluginInfo) -> None:
    """Register one plugin; a hook with no spec (a typo) or a second entry point of the same name is
    this plugin's error, not everyone's."""
    if manager.has_plugin(info.name):
        other = manager.get_plugin(info.name)
        raise PluginError(
            f"entry point name {info.name!r} is also used by {getattr(other, '__name__', other)!r}"
        )
    manager.register(plugin, name=info.name)
    unknown = [
        impl.function.__name__
        for hook in manager.get_hookcallers(plugin) or []
        if hook.spec is None
        for impl in hook.get_hookimpls()
        if impl.plugin is plugin
    ]
    if unknown:
        manager.unregister(plugin)
        raise PluginError(
            f"implements unknown hook(s) {', '.join(unknown)}; known hooks: {', '.join(_KNOWN_HOOKS)}"
        )


_KNOWN_HOOKS = [*_HOOK_TABLES, "pagellm_cli_commands"]


def _check_api_version(plugin: Any, info: PluginInfo) -> None:
    declared = getattr(plugin, "PAGELLM_PLUGIN_API", None)
    if declared is None:
        raise PluginError(
            f"plugin {info.name!r} ({info.distribution}) declares no PAGELLM_PLUGIN_API; "
            f"pagellm's plugin API is {API_VERSION}"
        )
    major, minor = _version_tuple(str(declared))
    our_major, our_minor = _version_tuple(API_VERSION)
    if major != our_major or minor > our_minor:
        raise PluginError(
            f"plugin {info.name!r} ({info.distribution} {info.version}) was written for plugin API {declared}, "
            f"but this pagellm provides {API_VERSION}; upgrade whichever is older"
        )


def _version_tuple(version: str) -> tuple[int, int]:
    parts = (version.split(".") + ["0"])[:2]
    try:
        return int(parts[0]), int(parts[1])
    except ValueError as exc:
        raise PluginError(f"plugin API version {version!r} is not MAJOR.MINOR") from exc


def _warn_deprecated_hooks(plugin: Any, info: PluginInfo) -> None:
    for old, new in DEPRECATED_HOOKS.items():
        if getattr(plugin, old, None) is None or hasattr(plugin, new):
            continue
        message = (
            f"plugin {info.name!r} ({info.distribution}) implements hook {old!r}, which was renamed to {new!r}; "
            f"the old name stops working in the next release"
        )
        logger.warning(message)
        warnings.warn(message, DeprecationWarning, stacklevel=2)


def _fill(
    registry: Registry, manager: pluggy.PluginManager, infos: dict[str, PluginInfo], strict: bool
) -> None:
    """Call each plugin's hooks one by one, so every registered name is traced to its distribution."""
    for hook_name in _KNOWN_HOOKS:
        for impl in getattr(manager.hook, hook_name).get_hookimpls():
            info = infos[impl.plugin_name]
            owner = f"{info.distribution} {info.version} (plugin {info.name!r})"
            try:
                result = impl.function()
            except Exception as exc:
                _skip_or_raise(info, f"hook {hook_name} raised", exc, strict)
                continue
            if hook_name == "pagellm_cli_commands":
                registry.cli_commands.extend(result or [])
                continue
            table = _HOOK_TABLES[hook_name]
            if table in _PARSER_KINDS:
                try:
                    for cls in result or []:
                        check_parser(cls, _PARSER_KINDS[table])
                except TypeError as exc:
                    _skip_or_raise(info, f"hook {hook_name} returned what is not a parser", exc, strict)
                    continue
            items = (result or {}).items() if table == "models" else ((cls.name, cls) for cls in result or [])
            for name, value in items:
                if table == "platforms" and "quantization_methods" in vars(value):
                    logger.warning(
                        "platform %r of %s sets quantization_methods, which pagellm no longer reads: a "
                        "quantization method declares what it needs (QuantMethod.requires) and a platform what "
                        "it has (Platform.capabilities)",
                        name,
                        owner,
                    )
                registry.add(table, name, value, owner)
