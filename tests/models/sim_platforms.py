"""A platform that runs on the host CPU but sizes its KV cache like a device with memory of its own."""

from __future__ import annotations

from pagellm.core.platform import Availability, Platform

MiB = 1 << 20


class SimAccelerator(Platform):
    """Runs on the host CPU, but measures its memory like a device of its own: 64 MiB, 16 MiB in use."""

    name = "sim_accel"
    device_type = "cpu"
    attention_backends = ("TORCH_SDPA",)

    @classmethod
    def availability(cls) -> Availability:
        return Availability.yes("simulated")

    @classmethod
    def total_memory(cls, index: int = 0) -> int:
        return 64 * MiB

    @classmethod
    def free_memory(cls, index: int = 0) -> int:
        return 48 * MiB
