"""The router's /metrics: every loaded child's Prometheus text with a `model` label on each sample, merged
so that each metric family appears once (its HELP and TYPE once, then every child's samples: Prometheus
rejects a family split in two), then the router's own gauges and counters per model."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagellm.server.router.registry import ModelRegistry

_STATES = ("loaded", "loading", "unloaded")
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created", "_info", "_gsum", "_gcount")


def label_value(value: str) -> str:
    """A label value escaped as Prometheus's text format wants it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def add_label(sample: str, name: str, value: str) -> str:
    """`metric{a="1"} 2` -> `metric{model="m",a="1"} 2` (and `metric 2` -> `metric{model="m"} 2`); a
    sample that has the label already is left as it is."""
    label = f'{name}="{label_value(value)}"'
    brace, space = sample.find("{"), sample.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        if f"{name}=" in sample[brace : sample.find("}", brace)]:
            return sample
        inner_empty = sample[brace + 1] == "}"
        return sample[: brace + 1] + label + ("" if inner_empty else ",") + sample[brace + 1 :]
    if space == -1:
        return sample
    return sample[:space] + "{" + label + "}" + sample[space:]


def _in_family(sample_name: str, family: str) -> bool:
    """Whether a sample belongs to a family: its name, or its name with a counter's, histogram's or
    summary's suffix."""
    return sample_name == family or (
        sample_name.startswith(family) and sample_name[len(family) :] in _SUFFIXES
    )


def _families(text: str) -> list[tuple[str, list[str], list[str]]]:
    """(family name, its HELP/TYPE lines, its samples) in the order the text has them."""
    families: list[tuple[str, list[str], list[str]]] = []
    current: tuple[str, list[str], list[str]] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                if current is None or current[0] != parts[2]:
                    current = (parts[2], [], [])
                    families.append(current)
                current[1].append(line)
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if current is None or not _in_family(name, current[0]):
            current = (name, [], [])
            families.append(current)
        current[2].append(line)
    return families


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """The children's metrics texts, given as (model name, text), as one text with a `model` label."""
    order: list[str] = []
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for model, text in texts:
        for family, comment_lines, lines in _families(text):
            if family not in headers:
                order.append(family)
                headers[family], samples[family] = comment_lines, []
            samples[family].extend(add_label(line, "model", model) for line in lines)
    out = []
    for family in order:
        out.extend(headers[family])
        out.extend(samples[family])
    return "\n".join(out) + "\n" if out else ""


def router_metrics(registry: ModelRegistry) -> str:
    """The router's own metrics: each model's state, loads and proxied requests."""
    state_lines, load_lines, request_lines = [], [], []
    for slot in registry.slots.values():
        model = label_value(slot.spec.name)
        for state in _STATES:
            value = 1 if slot.state == state else 0
            state_lines.append(f'pagellm:router_model_state{{model="{model}",state="{state}"}} {value}')
        load_lines.append(f'pagellm:router_model_loads_total{{model="{model}"}} {slot.loads}')
        request_lines.append(f'pagellm:router_requests_total{{model="{model}"}} {slot.requests}')
    return (
        "\n".join(
            [
                "# HELP pagellm:router_model_state 1 for the state each model is in (loaded, loading, unloaded).",
                "# TYPE pagellm:router_model_state gauge",
                *state_lines,
                "# HELP pagellm:router_model_loads_total Times each model was loaded (started).",
                "# TYPE pagellm:router_model_loads_total counter",
                *load_lines,
                "# HELP pagellm:router_requests_total Requests the router passed to each model.",
                "# TYPE pagellm:router_requests_total counter",
                *request_lines,
            ]
        )
        + "\n"
    )
