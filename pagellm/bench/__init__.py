"""`pagellm bench`: the workloads of shared/bench/README.md, pagellm's throughput, latency and serving on
them, the transformers and llama.cpp peers measured side by side in the same run, and every run's floor."""

from pagellm.bench.common import ThroughputResult
from pagellm.bench.floor import Floor, Machine, ModelShape, measure_machine
from pagellm.bench.latency import LatencyResult, run_latency
from pagellm.bench.peers import load_transformers_model, run_transformers
from pagellm.bench.throughput import run_pagellm, run_prefix_comparison
from pagellm.bench.workloads import Workload, model_m_path, resolve_model, w1, w3

__all__ = [
    "Floor",
    "LatencyResult",
    "Machine",
    "ModelShape",
    "ThroughputResult",
    "Workload",
    "load_transformers_model",
    "measure_machine",
    "model_m_path",
    "resolve_model",
    "run_latency",
    "run_pagellm",
    "run_prefix_comparison",
    "run_transformers",
    "w1",
    "w3",
]
