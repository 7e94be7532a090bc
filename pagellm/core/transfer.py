"""Host-to-device copies that do not stall the host.

A copy from ordinary (pageable) host memory to a CUDA device is synchronous whatever `non_blocking` says:
the host waits for the stream to reach it, so every such copy after a forward is queued waits for that
forward. Copies here go through page-locked memory from torch's caching host allocator instead, with
`non_blocking=True`: the host returns at once, and the allocator keeps the page-locked block until the
copy that reads it has run, so the caller may reuse or change its own array right away.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def pins_memory(device_type: str) -> bool:
    """Whether copies to this torch device type go through page-locked memory: the device is this
    process's accelerator (CUDA, ROCm, XPU, ...), whose runtime page-locks host memory."""
    if device_type == "cpu" or not torch.accelerator.is_available():
        return False
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == device_type


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; on the CPU the tensor itself."""
    if device.type == "cpu":
        return tensor
    if pins_memory(device.type):
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def copy_to(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a host tensor `src`, without stalling the host where the device allows."""
    if pins_memory(dst.device.type):
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
