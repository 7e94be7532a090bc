"""Ranks and groups: tensor-parallel ranks split each layer, pipeline-parallel ranks split the layers.

Global rank r is tensor rank r % tp of pipeline stage r // tp. Rank 0 is the driver: it runs the scheduler
and the sampler in the engine process, and sends every other rank each step's model inputs over a gloo
group (`control`); the model's own collectives (all-reduce, all-gather, stage-to-stage sends) run on the
platform's backend (gloo on CPU, nccl on CUDA).
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pagellm.core.errors import PagellmError

STARTUP_TIMEOUT_S = 300.0


class RankFailure(PagellmError):
    """A rank died, hung past the timeout or failed a collective: the engine cannot go on."""


@dataclass
class Group:
    """One process group as a layer sees it: its size, this process's rank in it, and the collectives.
    A group of one (the default) does nothing, so single-process code pays no branch cost beyond a test."""

    size: int = 1
    rank: int = 0
    ranks: list[int] = field(default_factory=lambda: [0])  # global ranks, in group order
    handle: Any = None  # torch.distributed ProcessGroup

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, group=self.handle)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` concatenated along `dim`, in rank order."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.handle)
        return torch.cat(parts, dim=dim)

    def send(self, tensor: torch.Tensor, to: int) -> None:
        """Send to the group's rank `to`."""
        dist.send(tensor.contiguous(), dst=self.ranks[to], group=self.handle)

    def recv(self, like: torch.Tensor, source: int) -> torch.Tensor:
        """Receive a tensor shaped like `like` from the group's rank `source`."""
        dist.recv(like, src=self.ranks[source], group=self.handle)
        return like


@dataclass
class Parallel:
    """This process's place: its global rank and its tensor- and pipeline-parallel groups, plus the gloo
    group over every rank that carries the driver's messages."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # device index on this machine
    tp: Group = field(default_factory=Group)
    pp: Group = field(default_factory=Group)
    control: Any = None  # a gloo ProcessGroup over all ranks (None in one process)
    startup: Any = None  # the default group, whose timeout allows for loading the model

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def first_stage(self) -> bool:
        return self.pp.rank == 0

    def broadcast(self, message: Any = None) -> Any:
        """From the driver to every rank: the driver passes `message`, the others get it."""
        data = [pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL) if self.is_driver else None]
        dist.broadcast_object_list(data, src=0, group=self.control)
        return message if self.is_driver else pickle.loads(data[0])

    def min(self, value: int) -> int:
        """The smallest `value` over all ranks (e.g. KV blocks that fit on every rank)."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)  # at start-up: the ranks may load at their own pace
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.startup)
        return int(tensor.item())

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` came from a collective (a peer gone, a timeout) rather than from the step's own
    code."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(s in text for s in ("gloo", "NCCL", "Connection reset"))


def init_parallel(
    rank: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    init_method: str,
    backend: str,
    timeout: float,
    local_rank: int | None = None,
) -> Parallel:
    """Join the process group of tp x pp ranks (every rank calls this with the same arguments but its
    rank) and build the groups. A step's collectives that wait longer than `timeout` seconds raise; joining
    and start-up wait at least STARTUP_TIMEOUT_S (ranks start and load at their own pace)."""
    world = tensor_parallel_size * pipeline_parallel_size
    if world == 1:
        return Parallel()
    wait = datetime.timedelta(seconds=timeout)
    startup = datetime.timedelta(seconds=max(timeout, STARTUP_TIMEOUT_S))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=startup)
    control = dist.new_group(list(range(world)), backend="gloo", timeout=wait)
    tp = pp = None
    # every rank creates every group, in the same order (torch.distributed's rule)
    for stage in range(pipeline_parallel_size):
        ranks = [stage * tensor_parallel_size + i for i in range(tensor_parallel_size)]
        handle = dist.new_group(ranks, backend=backend, timeout=wait)
        if rank in ranks:
            tp = Group(len(ranks), ranks.index(rank), ranks, handle)
    for column in range(tensor_parallel_size):
        ranks = [column + s * tensor_parallel_size for s in range(pipeline_parallel_size)]
        handle = dist.new_group(ranks, backend=backend, timeout=wait)
        if rank in ranks:
            pp = Group(len(ranks), ranks.index(rank), ranks, handle)
    local = rank if local_rank is None else local_rank
    return Parallel(rank, world, local, tp, pp, control, dist.group.WORLD)
