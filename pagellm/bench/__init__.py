"""`pagellm bench`: the workloads of shared/bench/README.md, pagellm's throughput and latency on them,
and the transformers peer measured side by side in the same run."""

from pagellm.bench.latency import LatencyResult, run_latency
from pagellm.bench.peers import load_transformers_model, run_transformers
from pagellm.bench.throughput import ThroughputResult, run_pagellm, run_prefix_comparison
from pagellm.bench.workloads import Workload, model_m_path, resolve_model, w1, w3

__all__ = [
    "LatencyResult",
    "ThroughputResult",
    "Workload",
    "load_transformers_model",
    "model_m_path",
    "resolve_model",
    "run_latency",
    "run_pagellm",
    "run_prefix_comparison",
    "run_transformers",
    "w1",
    "w3",
]
