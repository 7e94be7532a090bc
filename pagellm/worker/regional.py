"""Regional compilation: a decoder layer's code compiled once and run for every layer of its kind.

A model's forward traced as one graph makes inductor generate, and the C++ compiler build, every layer's
kernels and wrapper code thirty times over: model S's forward took 97 s on one core of the AMX Xeon from an
empty cache, 70 s of it in the C++ compiler. Marked as a nested compile region
(`torch.compiler.nested_compile_region`), a layer is traced once and its compiled code called again for each
layer that differs only in its weights (17 s for the same model). What may differ between layers without a
new region: the tensors the layer owns (weights, and the attention layer's `layer_index` buffer, which says
which cache and plan the opaque attention op uses). A layer whose trace differs (another quantized type,
another layer kind) gets a region of its own, up to one per layer.

The graph calls each region through Python (inductor's C++ wrapper cannot call a subgraph), which made model
S's decode steps 3-5% slower than the whole graph's, so a compile process saves this forward first and the
whole graph after it (worker/compiled_forward.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

DECODER_STACKS = ("layers", "h")
"""The names models give their list of decoder layers (`model.layers`, GPT-2's `transformer.h`)."""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the entries of its layer lists (`DECODER_STACKS`), without the
    placeholders of layers another pipeline stage runs. A vision tower's blocks are left out: they run
    outside the compiled forward."""
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in DECODER_STACKS:
            layers.extend(layer for layer in module if not isinstance(layer, nn.Identity))
    return layers


@contextlib.contextmanager
def layers_compiled_once(model: nn.Module) -> Iterator[int]:
    """While it lasts, each decoder layer's class has its forward marked as a nested compile region, so that
    `torch.compile` compiles a layer once; yields how many layers were marked. Marks nothing where the model
    has no layer list (the compile is then the whole graph's). The class, not each layer: a region bound
    to each layer as an instance attribute was reused with the first layer's weights (tokens wrong, caught
    by the tests). Dynamo's caches are reset first: a region traced for an earlier model of this process
    whose layers share the class (mixtral's, then gpt-oss's) made inductor fail on the next."""
    torch._dynamo.reset()
    layers = decoder_layers(model)
    originals: dict[type, Callable] = {}
    for layer in layers:
        cls = type(layer)
        if cls not in originals:
            originals[cls] = cls.__dict__.get("forward")
            cls.forward = torch.compiler.nested_compile_region(
                cls.forward, max_reuse_entries=max(len(layers), 8)
            )
    try:
        yield len(layers)
    finally:
        for cls, forward in originals.items():
            if forward is None:
                del cls.forward
            else:
                cls.forward = forward
