"""Short-conv weights that checkpoints keep apart per input (OLMo Hybrid's and Kimi Linear's `q_conv1d`,
`k_conv1d`, `v_conv1d`), joined into the one depthwise `conv1d.weight` over q, k and v side by side that the
recurrent layers run, as transformers' weight conversion joins them on loading."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagellm.core.errors import ConfigError

CONV_PARTS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


def join_conv_parts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each module's q, k and v conv weights joined into its `conv1d.weight`
    (concatenated along the channels in that order). The released files split the channels as q, k and v
    are wide; transformers' save_pretrained splits them in equal thirds (its conversion reversed): either
    way the concatenation is the conv over q, k, v side by side. Other tensors pass unchanged."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        part = next((p for p in CONV_PARTS if name.endswith(f".{p}")), None)
        if part is None:
            yield name, tensor
            continue
        prefix = name[: -len(part)]
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) == len(CONV_PARTS):
            del pending[prefix]
            yield prefix + "conv1d.weight", torch.cat([parts[p] for p in CONV_PARTS])
    if pending:
        raise ConfigError(f"checkpoint: the q/k/v conv weights of {sorted(pending)} are incomplete")
