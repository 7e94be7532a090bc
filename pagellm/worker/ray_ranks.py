"""`RayRanks`: the other ranks of a split model as Ray actors, so a deployment can span machines.

Ray places one actor per rank in a placement group (a bundle of one CPU, or one GPU, each; PACK, so they
stay on one machine when they fit) and each actor runs `run_rank`. The ranks meet over TCP at this
machine's address. Ray is an optional dependency (`pip install pagellm[ray]`); with no cluster running,
`ray.init()` starts a local one. The model must be at the same path on every machine.
"""

from __future__ import annotations

import logging
import socket

from pagellm.core.errors import ConfigError
from pagellm.worker.ranks import Ranks, RankStart, run_rank
from pagellm.worker.step import EngineSetup

logger = logging.getLogger("pagellm")


class _RankActor:
    def run(self, start: RankStart, rank: int) -> None:
        import ray

        logging.basicConfig(level=start.log_level)
        local_rank = 0 if ray.get_gpu_ids() else None  # Ray shows an actor only its own GPU
        run_rank(start, rank, local_rank)


class RayRanks(Ranks):
    def __init__(self, setup: EngineSetup):
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ConfigError(
                "--distributed-executor-backend ray needs Ray: pip install 'pagellm[ray]'"
            ) from None
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        host = ray.util.get_node_ip_address()
        super().__init__(setup, f"tcp://{host}:{_free_port()}")
        resource = "CPU" if setup.platform.device_type == "cpu" else "GPU"
        self._group = placement_group([{resource: 1}] * (self.world - 1), strategy="PACK")
        ray.get(self._group.ready(), timeout=self.timeout)
        actor = ray.remote(_RankActor)
        self.actors, self.runs = {}, {}
        for rank in range(1, self.world):
            self.actors[rank] = actor.options(
                num_cpus=1 if resource == "CPU" else 0,
                num_gpus=1 if resource == "GPU" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, rank - 1),
            ).remote()
            self.runs[rank] = self.actors[rank].run.remote(self.start, rank)
        logger.info(
            "started %d Ray rank actors: tensor parallel %d x pipeline parallel %d (%s, %s)",
            self.world - 1,
            self.tp,
            self.pp,
            self.start.dist_backend,
            self.start.init_method,
        )

    def exited(self) -> dict[int, str]:
        import ray

        ended = {}
        for rank, run in self.runs.items():
            done, _ = ray.wait([run], timeout=0)
            if done:
                try:
                    ray.get(run)
                    ended[rank] = "returned"
                except Exception as exc:  # the actor died or its run raised
                    ended[rank] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return ended

    def _end(self, wait: float) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=wait)
        for actor in self.actors.values():
            ray.kill(actor)
        remove_placement_group(self._group)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
