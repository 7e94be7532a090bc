"""Engine copies as Ray actors (`data_parallel_size` > 1 with `distributed_executor_backend="ray"`), so
they can run on other machines of a Ray cluster.

`EngineProcess` talks to its engine over two ZeroMQ sockets whatever runs it; here the engine loop
(`core_process.main`) runs inside an actor that connects back over TCP, and `RayEngineHandle` gives the
front end the Popen calls it uses (poll, wait, kill, returncode) in terms of the actor. With no cluster
running, `ray.init()` starts a local one. The model must be at the same path on every machine.
"""

from __future__ import annotations

import subprocess
from typing import Any

from pagellm.core.errors import ConfigError


class _EngineActor:
    def run(self, commands: str, turns: str) -> int:
        from pagellm.engine.core_process import main

        return main(commands, turns)


class RayEngineHandle:
    """A Ray actor running one engine, seen through Popen's calls."""

    def __init__(
        self, commands: str, turns: str, env: dict[str, str] | None, num_cpus: float, num_gpus: float
    ):
        import ray

        threads = (env or {}).get("OMP_NUM_THREADS")
        runtime_env = {"env_vars": {"OMP_NUM_THREADS": threads}} if threads else None
        self._actor = (
            ray.remote(_EngineActor)
            .options(num_cpus=num_cpus, num_gpus=num_gpus, runtime_env=runtime_env)
            .remote()
        )
        self._run = self._actor.run.remote(commands, turns)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        import ray

        if self.returncode is None and ray.wait([self._run], timeout=0)[0]:
            try:
                self.returncode = int(ray.get(self._run))
            except Exception:  # the actor died (killed, its node lost) or the loop raised
                self.returncode = -9
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import ray

        ray.wait([self._run], timeout=timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired("ray engine actor", timeout)
        return self.returncode

    def kill(self) -> None:
        import ray

        ray.kill(self._actor)


def ray_launcher(device: str) -> Any:
    """The `launch` argument of `EngineProcess` for engines as Ray actors: one CPU each (their torch
    threads come from OMP_NUM_THREADS), or one GPU each."""
    try:
        import ray
    except ImportError:
        raise ConfigError("distributed_executor_backend ray needs Ray: pip install 'pagellm[ray]'") from None
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True)
    import torch

    gpu = device != "cpu" and (device != "auto" or torch.cuda.is_available())

    def launch(commands: str, turns: str, env: dict[str, str] | None) -> RayEngineHandle:
        return RayEngineHandle(commands, turns, env, num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0)

    return launch
