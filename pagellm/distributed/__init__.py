"""Process groups on torch.distributed: which rank this process is, and the collectives the parallel
layers and the model runner use (docs/architecture.md, "Tensor and pipeline parallelism")."""

from pagellm.distributed.parallel_state import Group, Parallel, RankFailure, init_parallel

__all__ = ["Group", "Parallel", "RankFailure", "init_parallel"]
