"""`LoRAManager`: adapters in `max_loras` slots on the device (least recently used one replaced), up to
`max_cpu_loras` kept loaded in memory, and each step's grouping of tokens by slot.

Every targeted `Linear` gets per-slot buffers stacked by slot: A [slots x W, in] and B^T [slots x W, out]
(W = shards x R, R = max_lora_rank, zero-padded; B block-diagonal over a fused layer's shards, the
scaling folded in). A step's adapter tokens then take two matmuls a layer (`models.context.LoRABatch`);
rows of the base model are never touched.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.lora.adapter import LoRAAdapter, load_adapter
from pagellm.lora.request import LoRARequest
from pagellm.models.layers.linear import Linear, LoRAWeights

_LAYERS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}


class LoRAManager:
    def __init__(
        self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int, dtype: torch.dtype, device
    ):
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max(max_cpu_loras, max_loras)
        self.modules: dict[str, Linear] = {}
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, Linear) and leaf in _LAYERS:
                width = _LAYERS[leaf] * max_rank
                module.lora = LoRAWeights(
                    torch.zeros(max_loras * width, module.in_features, dtype=dtype, device=device),
                    torch.zeros(max_loras * width, module.out_features, dtype=dtype, device=device),
                    width,
                )
                self.modules[name] = module
        if not self.modules:
            raise ConfigError("enable_lora: this model has no layers LoRA can target (q/k/v/o, gate/up/down)")
        self.loaded: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()  # LRU, in memory
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id per slot
        self._slot_use: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))

    def add(self, request: LoRARequest) -> None:
        """Load an adapter into memory (a ConfigError for one pagellm cannot run), if not there yet."""
        entry = self.loaded.get(request.lora_int_id)
        if entry is not None and entry[0] == request:
            self.loaded.move_to_end(request.lora_int_id)
            return
        adapter = load_adapter(request.lora_path, self.max_rank)
        missing = sorted(set(adapter.weights) - set(self.modules))
        if missing:
            raise ConfigError(
                f"LoRA adapter {request.lora_path}: modules {missing[:3]} are not in this model"
            )
        if entry is not None:  # the same id with another name or path: its slot holds old weights
            self._evict(request.lora_int_id)
        self.loaded[request.lora_int_id] = (request, adapter)
        # over max_cpu_loras: forget the least recently used adapters that are in no slot
        spare = [i for i in self.loaded if i not in self.slots and i != request.lora_int_id]
        for old in spare[: max(0, len(self.loaded) - self.max_cpu_loras)]:
            del self.loaded[old]

    def activate(self, requests: Iterable[LoRARequest]) -> dict[int, int]:
        """Slots for this step's adapters (at most max_loras: the scheduler sees to it): lora_int_id -> slot."""
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step, more than max_loras ({self.max_loras})")
        mapping = {}
        for lora_id, request in wanted.items():
            if lora_id in self.slots:
                slot = self.slots.index(lora_id)
            else:
                self.add(request)
                slot = next(s for s in self._slot_use if self.slots[s] not in wanted)  # least recently used
                self._write(slot, self.loaded[lora_id][1])
                self.slots[slot] = lora_id
            self._slot_use.move_to_end(slot)
            mapping[lora_id] = slot
        return mapping

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        r = self.max_rank
        for name, module in self.modules.items():
            width = module.lora.width
            a_buf = module.lora.a[slot * width : (slot + 1) * width]
            b_buf = module.lora.b[slot * width : (slot + 1) * width]
            a_buf.zero_()
            b_buf.zero_()
            offsets = [0]
            for size in module.output_sizes:
                offsets.append(offsets[-1] + size)
            for shard, (a, b) in adapter.weights.get(name, {}).items():
                rank = a.shape[0]
                a_buf[shard * r : shard * r + rank].copy_(a)
                columns = slice(offsets[shard], offsets[shard + 1])
                b_buf[shard * r : shard * r + rank, columns].copy_((b * adapter.scaling).T)

    def _evict(self, lora_id: int) -> None:
        if lora_id in self.slots:
            self.slots[self.slots.index(lora_id)] = None
