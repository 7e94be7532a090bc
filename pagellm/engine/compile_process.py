"""`python -m pagellm.engine.compile_process REQUEST`: the background compile of `--compile-in-background`.

It builds the engine's model as the engine did (its config with the start-up's choices pinned: the attention
backend and block size, no timings, a KV cache of one request), checks that the model's key is the one the
engine asked for, compiles the forward ahead of time and saves it where the engine looks
(worker/compiled_forward.py): with each decoder layer compiled once where the request says so
(worker/regional.py; model S 17 s on one core of the AMX Xeon, which the engine asks for first), else as one
whole graph (65 s there; its steps a few percent faster). It runs niced on one thread, so the serving process keeps the cores, and exits
when its parent does. Then, where the engine chose its attention backend itself, it times the backends for
the next start (`time_attention_for_next_start`).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
from pathlib import Path

logger = logging.getLogger("pagellm")


def main(request_file: str) -> int:
    import torch

    from pagellm.engine.llm_engine import load_weights
    from pagellm.engine.setup import resolve_engine
    from pagellm.worker import compiled_forward
    from pagellm.worker.model_runner import ModelRunner
    from pagellm.worker.ranks import exit_with_parent

    exit_with_parent()
    os.nice(10)
    threads = torch.get_num_threads()  # the engine's; the timings after the compile take them again
    torch.set_num_threads(1)
    with open(request_file, "rb") as f:
        request: compiled_forward.CompileRequest = pickle.load(f)
    setup = resolve_engine(request.config)
    weights = load_weights(setup)
    runner = ModelRunner(setup, weights, ())
    key = runner.compiler.key()
    if key != request.key:
        logger.error("the model built here has key %s, the engine's %s: not compiled", key, request.key)
        return 2
    started = time.monotonic()
    compiled = runner.compiler.compile_ahead(regional=request.regional)
    if compiled is None:
        logger.error("the platform %s compiles nothing ahead of time", setup.platform.name)
        return 2
    compiled_forward.save(compiled, Path(request.path))
    what = "layers compiled once" if request.regional else "compiled"
    logger.info("%s in %.1fs, saved to %s", what, time.monotonic() - started, request.path)
    if request.timings_config is not None:
        time_attention_for_next_start(request.timings_config, threads)
    return 0


def time_attention_for_next_start(config, threads: int) -> None:
    """The attention backends timed for `config` (the engine's own) as a start times them, on the engine's
    `threads`, into the timings cache, where the next start finds them. A start whose kernels were still
    building picked its backend by preference and timed nothing, and timing costs the next start ~3 s on two
    cores (FLEX_ATTENTION's compile on its first call, ~2.6 s of it for model S). As at a start, timings
    taken while other processes kept the machine busy (a request being served beside this) are not cached."""
    import torch

    from pagellm.engine.setup import resolve_engine

    torch.set_num_threads(threads)
    started = time.monotonic()
    try:
        resolve_engine(config)
    except Exception as e:  # the next start times them itself
        logger.warning("timing the attention backends failed (%s: %s)", type(e).__name__, e)
        return
    logger.info("attention backends timed for the next start in %.1fs", time.monotonic() - started)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s compile %(message)s")
    sys.exit(main(sys.argv[1]))
