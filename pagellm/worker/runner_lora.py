"""The model runner's LoRA part (`enable_lora`): the adapters' device slots on the model's `Linear`s, and
each step's (slot, token rows) groups for the forward context."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from pagellm.core.config import EngineConfig
from pagellm.lora.manager import LoRAManager
from pagellm.lora.request import LoRARequest
from pagellm.models.context import LoRABatch
from pagellm.worker.input_batch import host_to_device
from pagellm.worker.step import ScheduledRequest


class RunnerLoRA:
    def __init__(self, model: nn.Module, config: EngineConfig, dtype: torch.dtype, device: torch.device):
        self.device = device
        self.manager = LoRAManager(
            model,
            config.max_loras,
            config.max_lora_rank,
            config.max_cpu_loras or config.max_loras,
            dtype,
            device,
        )

    def add(self, request: LoRARequest) -> None:
        """Load an adapter into memory (ConfigError when it cannot run)."""
        self.manager.add(request)

    def batch(self, scheduled: Sequence[ScheduledRequest], cu: np.ndarray) -> LoRABatch | None:
        """The step's adapter tokens (request i's rows are cu[i]:cu[i + 1]) and their slots, the step's
        adapters put in slots first; None when every request runs the base model."""
        slots = self.manager.activate(r.lora_request for r in scheduled if r.lora_request is not None)
        if not slots:
            return None
        rows, row_slots = [], []
        for i, r in enumerate(scheduled):
            if r.lora_request is not None:
                rows.append(np.arange(cu[i], cu[i + 1]))
                row_slots.append(np.full(cu[i + 1] - cu[i], slots[r.lora_request.lora_int_id]))
        return LoRABatch(
            host_to_device(np.concatenate(rows), self.device),
            host_to_device(np.concatenate(row_slots), self.device),
            self.manager.max_loras,
        )
