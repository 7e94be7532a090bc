"""Build a model class and fill it from a checkpoint's (name, tensor) stream.

Models map checkpoint names onto their own parameters with `copy_weights`; `load_model` checks that
every parameter was filled, so a checkpoint that does not fit the model fails at load, not as garbage
output.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.base import CausalLM, ModelInit

Adapt = Callable[[str, torch.Tensor], tuple[str, torch.Tensor] | None]
"""Translate one checkpoint tensor to the model's naming (and layout), or drop it (None)."""


def resolve_model_class(hf_config, models: dict[str, str]) -> str:
    """The "module:Class" registered for the config's architecture."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in models:
            return models[arch]
    named = ", ".join(architectures) or f"none (model_type {getattr(hf_config, 'model_type', '?')!r})"
    raise ConfigError(
        f"model architecture {named} is not supported; supported architectures: {', '.join(sorted(models))}. "
        f"Install a plugin that registers it, or use a model of a supported architecture."
    )


def import_model_class(model_cls_path: str) -> type[CausalLM]:
    module_name, _, class_name = model_cls_path.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def load_model(
    model_cls_path: str,
    init: ModelInit,
    weights: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | str,
) -> CausalLM:
    """Build the model directly on `device` in `init.dtype`, load `weights`, let quant methods repack."""
    model_cls = import_model_class(model_cls_path)
    with torch.device(device):
        model = model_cls(init)
    if init.quant_method is not None:
        init.quant_method.prepare_model(model)
        weights = init.quant_method.checkpoint_weights(weights, model_cls.float_modules)
    loaded = model.load_weights(weights)
    if loaded is not None:
        missing = [name for name, _ in model.named_parameters() if name not in loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ConfigError(f"the checkpoint has no weights for {shown} of {model_cls.__name__}")
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(module)
    if init.quant_method is not None:
        init.quant_method.process_model_after_loading(model)
    return model.eval().requires_grad_(False)


def copy_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Sequence[tuple[str, str, int]] = (),
    adapt: Adapt | None = None,
) -> set[str]:
    """Copy checkpoint tensors into `model`'s parameters of the same name; return the names filled.

    `stacked` lists (fused module, checkpoint module, shard index) for layers that fuse several checkpoint
    tensors, e.g. ("qkv_proj", "k_proj", 1). A parameter with a `weight_loader(param, tensor, shard)`
    attribute (set by a quant method) loads itself.
    """
    loaded = set()
    for name, tensor in weights:
        if adapt is not None:
            adapted = adapt(name, tensor)
            if adapted is None:
                continue
            name, tensor = adapted
        shard = None
        for fused, part, index in stacked:
            if f".{part}." in name:
                name, shard = name.replace(f".{part}.", f".{fused}."), index
                break
        _copy_one(model, name, tensor, shard)
        loaded.add(name)
    return loaded


def _copy_one(model: nn.Module, name: str, tensor: torch.Tensor, shard: int | None) -> None:
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        module = None
    param = getattr(module, attr, None)
    if not isinstance(param, torch.Tensor):
        raise ConfigError(f"checkpoint tensor {name!r} has no counterpart in {type(model).__name__}")
    narrow = getattr(module, "narrow_checkpoint", None)
    if narrow is not None:  # tensor parallelism: this rank's slice only
        tensor = narrow(attr, tensor, shard)
    if isinstance(tensor, CheckpointSlice):
        tensor = tensor.load()
    weight_loader = getattr(param, "weight_loader", None)
    if weight_loader is not None:
        weight_loader(param, tensor, shard)
    elif shard is not None:
        module.load_shard(param, tensor, shard)
    elif param.shape != tensor.shape:
        raise ConfigError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
            f"{tuple(param.shape)}; the config does not match the weights"
        )
    else:
        param.data.copy_(tensor)


class CheckpointSlice:
    """A safetensors tensor not read yet: `narrow` reads only the part asked for (a tensor-parallel rank's
    rows or columns), `load` all of it."""

    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def load(self) -> torch.Tensor:
        return self._slice[:]


def iter_checkpoint_weights(
    model_dir: str | os.PathLike, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    """(name, tensor) for every tensor of a Hugging Face checkpoint directory, one file at a time.

    Prefers safetensors (sharded by index json, or every *.safetensors file) over pytorch_model*.bin.
    `lazy`: safetensors tensors come as `CheckpointSlice`s, read when copied, and then only the part the
    layer keeps (for a model class whose name mapping does not touch tensor data: `supports_parallel`)."""
    root = Path(model_dir)
    files = _checkpoint_files(root, "model.safetensors.index.json", "*.safetensors")
    if files:
        from safetensors import safe_open

        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, CheckpointSlice(f, name) if lazy else f.get_tensor(name)
        return
    files = _checkpoint_files(root, "pytorch_model.bin.index.json", "pytorch_model*.bin")
    if not files:
        raise ConfigError(f"no *.safetensors or pytorch_model*.bin weights in {root}")
    for path in files:
        yield from torch.load(path, map_location="cpu", weights_only=True, mmap=True).items()


def _checkpoint_files(root: Path, index_name: str, pattern: str) -> list[Path]:
    index = root / index_name
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    return sorted(root.glob(pattern))


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and buffers take on their device (tied tensors counted once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
