"""The pluggy hooks a pagellm plugin implements.

A plugin is the object (usually a module) that a `pagellm.plugins` entry point names. It declares the
plugin API version it was written for as `PAGELLM_PLUGIN_API = "1.0"` and implements any of these hooks,
marked with `pagellm.plugins.hookimpl`. It may set `PAGELLM_PLUGIN_PRIORITY` (int, default 0): plugins
load in descending priority, then name order.

Every hook is called once per process, by `pagellm.plugins.load_plugins()` (the first time an engine, the
server or the CLI needs the registry), and once per plugin: the loader calls each plugin's implementation
by itself, so every name it returns is recorded with the distribution that registered it
(docs/architecture.md, "Why the loader calls hooks one by one"). No hook takes arguments. Returning None
is the same as returning nothing. A hook that raises is reported at WARNING and that plugin's result is
skipped, unless the plugin was asked for in `PAGELLM_PLUGINS`: then start-up fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

from pagellm.core.attention import AttentionBackend
from pagellm.core.kv_connector import KVConnector
from pagellm.core.parsers import ReasoningParser, ToolParser
from pagellm.core.platform import Platform
from pagellm.core.quant import QuantMethod

if TYPE_CHECKING:
    import click

hookspec = pluggy.HookspecMarker("pagellm")
hookimpl = pluggy.HookimplMarker("pagellm")


@hookspec
def pagellm_platforms() -> list[type[Platform]]:
    """Return the device families this plugin provides.

    Called when plugins load, before any platform is selected; import only what the classes' module
    needs, and leave device runtimes alone (selection calls `availability()` later, which must stay cheap).

    :returns: `pagellm.core.platform.Platform` subclasses (the classes, not instances). Each is
        registered under its `name`, which users pass to `--device`; a name another plugin already
        registered is an error naming both distributions.
    """


@hookspec
def pagellm_attention_backends() -> list[type[AttentionBackend]]:
    """Return the paged-attention implementations this plugin provides.

    Called when plugins load. A backend may be registered whatever the machine: the selector asks its
    `unsupported_reasons` per platform and model, and reports them.

    :returns: `pagellm.core.attention.AttentionBackend` subclasses. Each is registered under its `name`
        (upper case, what users pass to `--attention-backend` and what platforms' preference lists name);
        a name already registered is an error naming both distributions.
    """


@hookspec
def pagellm_quant_methods() -> list[type[QuantMethod]]:
    """Return the weight formats this plugin provides.

    Called when plugins load. A checkpoint's `quantization_config` selects a method through its
    `matches_checkpoint`; `--quantization NAME` selects one by name.

    :returns: `pagellm.core.quant.QuantMethod` subclasses. Each is registered under its `name`; a name
        already registered is an error naming both distributions.
    """


@hookspec
def pagellm_models() -> dict[str, str]:
    """Return the model architectures this plugin provides.

    Called when plugins load; a model class itself is imported only when a model of its architecture
    is used.

    :returns: {Hugging Face architecture name (as in a config's `architectures`): "module:Class"}, the
        class a `pagellm.models.base.CausalLM` subclass. An architecture already registered is an error
        naming both distributions.
    """


@hookspec
def pagellm_reasoning_parsers() -> list[type[ReasoningParser]]:
    """Return the reasoning parsers this plugin provides (`--reasoning-parser NAME`; plugin API 1.1).

    Called when plugins load.

    :returns: `pagellm.core.parsers.ReasoningParser` classes (subclasses, or any class with its members):
        a `name`, an `end_tag` (the text that ends the thinking: a grammar applies after it) and
        `split(text, final) -> (reasoning, content)`, a function of the whole reply so far that leaves out
        of both a tail that may still become a tag unless `final` (see
        `pagellm.server.reasoning.ThinkTagParser`). A class without them makes the loader skip this
        plugin's parsers; a name already registered is an error naming both distributions.
    """


@hookspec
def pagellm_tool_parsers() -> list[type[ToolParser]]:
    """Return the tool-call parsers this plugin provides (`--tool-call-parser NAME`; plugin API 1.1).

    Called when plugins load.

    :returns: `pagellm.core.parsers.ToolParser` classes (subclasses, or any class with its members): a
        `name` and `parse(text, final) -> ToolCallParse` (content and (name, arguments JSON) calls), a
        function of the whole reply so far that holds back what may still change unless `final` (see
        `pagellm.server.tool_parsers.HermesToolParser`). A class without them makes the loader skip this
        plugin's parsers; a name already registered is an error naming both distributions.
    """


@hookspec
def pagellm_kv_connectors() -> list[type[KVConnector]]:
    """Return the KV connectors this plugin provides (`--kv-transfer-config`; plugin API 1.2).

    Called when plugins load. A connector moves KV-cache blocks between an engine and the outside (another
    engine over a network or a fabric, a directory), for disaggregated prefill and decode.

    :returns: `pagellm.core.kv_connector.KVConnector` subclasses. Each is registered under its `name`,
        which users pass as `kv_transfer_config.kv_connector`; a name already registered is an error naming
        both distributions.
    """


@hookspec
def pagellm_cli_commands() -> list[click.Command]:
    """Return commands to add to the `pagellm` command line.

    Called when plugins load; the CLI loads plugins when it lists its commands or meets one it does not
    know.

    :returns: `click.Command` objects. A command whose name a built-in command already has is left out.
    """
