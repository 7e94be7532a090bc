"""Plugin discovery: entry points of the `pagellm.plugins` group, loaded once per process into a Registry."""

from pagellm.plugins.hookspecs import hookimpl, hookspec
from pagellm.plugins.loader import (
    API_VERSION,
    DEPRECATED_HOOKS,
    ENTRY_POINT_GROUP,
    load_plugins,
    reset_plugins,
)

__all__ = [
    "API_VERSION",
    "DEPRECATED_HOOKS",
    "ENTRY_POINT_GROUP",
    "hookimpl",
    "hookspec",
    "load_plugins",
    "reset_plugins",
]
