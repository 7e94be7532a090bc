"""The ranks of a model split over several processes (tensor and pipeline parallelism).

The engine's process is rank 0, the driver. The other ranks are started by `RankProcesses` (here: Python
children on this machine, a `-c` program, not multiprocessing's spawn, so a user's script without a
__main__ guard is not re-run) or by `ray_ranks.RayRanks` (Ray actors in a placement group, so ranks can
sit on other machines); the engine picks one by `distributed_executor_backend`. Each gets the driver's
start-up decisions (`RankStart`: the `EngineSetup`, pickled), joins one torch.distributed group, builds
its own `ModelRunner` with its share of the weights and runs `ModelRunner.serve` until the driver says
stop.

A rank that dies or stops answering surfaces as a failed collective on the driver; `Ranks.failure()`
turns that into a `RankFailure` naming the rank.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

from pagellm.core.errors import ConfigError
from pagellm.core.registry import Registry
from pagellm.distributed import Parallel, RankFailure, init_parallel
from pagellm.distributed.parallel_state import is_collective_failure
from pagellm.models.loader import iter_checkpoint_weights
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.step import EngineSetup

logger = logging.getLogger("pagellm")


@dataclass
class RankStart:
    """What every rank needs to join and build its part of the model."""

    setup: EngineSetup
    init_method: str
    dist_backend: str
    threads: int | None  # torch threads per rank on CPU (None: leave torch's default)
    log_level: int


class Ranks:
    """Ranks 1..world-1 of `setup`'s tensor x pipeline split (subclasses start them); `join()` makes this
    process rank 0 of the group, waiting for every rank up to the distributed timeout."""

    def __init__(self, setup: EngineSetup, init_method: str):
        config = setup.config
        self.tp, self.pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.world = self.tp * self.pp
        self.timeout = config.distributed_timeout
        self.closed = False
        threads = None
        self._threads_before = torch.get_num_threads()
        if setup.platform.device_type == "cpu":  # the ranks share the machine's cores (until close)
            threads = max(1, self._threads_before // self.world)
            torch.set_num_threads(threads)
        self.start = RankStart(
            # the registry holds what plugins registered in this process; the ranks load their own
            dataclasses.replace(setup, registry=Registry()),
            init_method,
            setup.platform.dist_backend,
            threads,
            logger.getEffectiveLevel(),
        )

    def join(self) -> Parallel:
        if torch.distributed.is_initialized():
            gc.collect()  # an engine only a reference cycle keeps alive: its finalizer stops its ranks
        if torch.distributed.is_initialized():
            self.close(wait=0)
            raise ConfigError(
                "another engine with tensor or pipeline parallelism runs in this process; call its "
                "shutdown() first (one such engine per process)"
            )
        try:
            return init_parallel(
                0, self.tp, self.pp, self.start.init_method, self.start.dist_backend, self.timeout
            )
        except Exception as exc:
            failure = self.failure(exc)
            self.close(wait=0)
            if failure is not None:
                raise failure from exc
            raise

    def exited(self) -> dict[int, str]:
        """Ranks that have ended, each with how (an exit code, an error)."""
        raise NotImplementedError

    def failure(self, exc: BaseException) -> RankFailure | None:
        """A RankFailure naming the rank when `exc` (raised in a step or at start-up) means the ranks can no
        longer work together; None when it is the step's own error (the ranks are fine)."""
        time.sleep(0.2)  # a peer's connection reset can arrive just before its exit code
        exited = self.exited()
        if not exited and not is_collective_failure(exc):
            return None
        if exited:
            what = ", ".join(f"rank {rank} ({how})" for rank, how in sorted(exited.items())) + " ended"
        else:
            what = f"a rank did not answer within {self.timeout:g}s (distributed_timeout) or failed"
        return RankFailure(f"tensor/pipeline parallel engine failed: {what}: {exc}")

    def close(self, wait: float = 10.0) -> None:
        """Wait up to `wait` seconds for the ranks to end (after the driver's stop), then end them, and give
        this process its threads back."""
        self.closed = True
        self._end(wait)
        torch.set_num_threads(self._threads_before)

    def _end(self, wait: float) -> None:
        raise NotImplementedError


class RankProcesses(Ranks):
    """Ranks as Python children of this process, meeting through a rendezvous file in a private folder."""

    def __init__(self, setup: EngineSetup):
        self._dir = tempfile.mkdtemp(prefix="pagellm-ranks-")
        super().__init__(setup, f"file://{self._dir}/rendezvous")
        with open(os.path.join(self._dir, "start.pkl"), "wb") as f:
            pickle.dump(self.start, f, protocol=pickle.HIGHEST_PROTOCOL)
        self.processes = {
            rank: subprocess.Popen([sys.executable, "-c", _CHILD, self._dir, str(rank)])
            for rank in range(1, self.world)
        }
        logger.info(
            "started %d rank processes: tensor parallel %d x pipeline parallel %d (%s)",
            self.world - 1,
            self.tp,
            self.pp,
            self.start.dist_backend,
        )

    def exited(self) -> dict[int, str]:
        codes = {rank: p.poll() for rank, p in self.processes.items()}
        return {rank: f"exit code {code}" for rank, code in codes.items() if code is not None}

    def _end(self, wait: float) -> None:
        deadline = time.monotonic() + wait
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def run_rank(start: RankStart, rank: int, local_rank: int | None = None) -> None:
    """Join as `rank`, build this rank's part of the model, serve the driver until it says stop."""
    if start.threads is not None:
        torch.set_num_threads(start.threads)
    setup = start.setup
    config = setup.config
    parallel = init_parallel(
        rank,
        config.tensor_parallel_size,
        config.pipeline_parallel_size,
        start.init_method,
        start.dist_backend,
        config.distributed_timeout,
        local_rank,
    )
    try:
        runner = ModelRunner(
            setup, iter_checkpoint_weights(setup.source.directory, lazy=True), (), parallel=parallel
        )
        runner.serve()
    finally:
        parallel.close()


def main(directory: str, rank: int) -> int:
    """A rank process of `RankProcesses`."""
    with open(os.path.join(directory, "start.pkl"), "rb") as f:
        start: RankStart = pickle.load(f)
    logging.basicConfig(level=start.log_level, format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    exit_with_parent()
    try:
        run_rank(start, rank)
    except Exception:
        logger.exception("rank %d failed", rank)
        return 1
    return 0


def exit_with_parent() -> None:
    """End this process when its parent is gone: a rank rather than at the next collective's timeout, a
    compile process (engine/compile_process.py) rather than for nobody."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="pagellm-parent-watch", daemon=True).start()


_CHILD = "import sys; from pagellm.worker.ranks import main; sys.exit(main(sys.argv[1], int(sys.argv[2])))"
