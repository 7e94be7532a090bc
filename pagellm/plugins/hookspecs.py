"""The pluggy hooks a pagellm plugin implements. Each is called once per process, when plugins load.

A plugin is the object (usually a module) that a `pagellm.plugins` entry point names. It declares the
plugin API version it was written for as `PAGELLM_PLUGIN_API = "1.0"` and implements any of these hooks,
marked with `pagellm.plugins.hookimpl`. It may set `PAGELLM_PLUGIN_PRIORITY` (int, default 0): plugins
load in descending priority, then name order.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("pagellm")
hookimpl = pluggy.HookimplMarker("pagellm")


@hookspec
def pagellm_platforms() -> list:
    """Return the `Platform` subclasses this plugin provides (device families)."""


@hookspec
def pagellm_attention_backends() -> list:
    """Return the `AttentionBackend` subclasses this plugin provides."""


@hookspec
def pagellm_quant_methods() -> list:
    """Return the `QuantMethod` subclasses this plugin provides."""


@hookspec
def pagellm_models() -> dict:
    """Return {Hugging Face architecture name: "module:Class"} for the model classes this plugin provides."""


@hookspec
def pagellm_cli_commands() -> list:
    """Return `click.Command` objects to add to the `pagellm` command line."""
