"""Settings given as JSON objects (`speculative_config`, `kv_transfer_config`, `pooler_config`): one parser
for the checks they share, so each reports a bad value the same way."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pagellm.core.errors import ConfigError


def json_setting(value: dict[str, Any] | str | None, name: str, fields_of: type, example: str) -> dict | None:
    """`value` (JSON text or a dict) as a dict whose keys are all fields of the dataclass `fields_of`;
    None when unset (None, "" or {}); a ConfigError naming `name` otherwise."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: expected a JSON object such as {example}")
    known = {f.name for f in dataclasses.fields(fields_of)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{name}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    return value
