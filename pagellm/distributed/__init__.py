"""Process groups on torch.distributed: which rank this process is, and the collectives the parallel
layers and the executor use (docs/architecture.md, "Parallelism")."""

from pagellm.distributed.parallel_state import Group, Parallel, RankFailure, init_parallel

__all__ = ["Group", "Parallel", "RankFailure", "init_parallel"]
