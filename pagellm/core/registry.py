"""`Registry`: what the loaded plugins registered, with the distribution that registered each name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagellm.core.attention import AttentionBackend
from pagellm.core.errors import PluginError
from pagellm.core.kv_connector import KVConnector
from pagellm.core.parsers import ReasoningParser, ToolParser
from pagellm.core.platform import Platform
from pagellm.core.quant import QuantMethod


@dataclass
class PluginInfo:
    """One entry point of the `pagellm.plugins` group, loaded or not."""

    name: str
    distribution: str
    version: str
    value: str
    loaded: bool = False
    error: str | None = None


@dataclass
class Registry:
    platforms: dict[str, type[Platform]] = field(default_factory=dict)
    attention_backends: dict[str, type[AttentionBackend]] = field(default_factory=dict)
    quant_methods: dict[str, type[QuantMethod]] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)  # HF architecture -> "module:Class"
    reasoning_parsers: dict[str, type[ReasoningParser]] = field(default_factory=dict)
    tool_parsers: dict[str, type[ToolParser]] = field(default_factory=dict)
    kv_connectors: dict[str, type[KVConnector]] = field(default_factory=dict)
    cli_commands: list[Any] = field(default_factory=list)
    plugins: list[PluginInfo] = field(default_factory=list)
    owners: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, name) -> "dist (plugin)"

    def add(self, kind: str, name: str, value: Any, owner: str) -> None:
        """Register `value` under `name` in the table `kind`; a name taken twice is an error naming both."""
        table = getattr(self, kind)
        if name in table:
            raise PluginError(
                f"{kind[:-1].replace('_', ' ')} {name!r} is registered twice: by {self.owners[(kind, name)]} "
                f"and by {owner}; uninstall one, or leave one out with PAGELLM_PLUGINS"
            )
        table[name] = value
        self.owners[(kind, name)] = owner

    def owner(self, kind: str, name: str) -> str:
        return self.owners.get((kind, name), "?")
