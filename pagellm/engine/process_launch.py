"""An engine process launched before its engine's settings are known: the child process started and its two
sockets bound, the settings sent later (`core_process.EngineProcess` adopts the launch). `pagellm serve`
launches it first thing, so the child imports torch and the engine while the front end imports the server,
in parallel on two cores, instead of one after the other (about 2 s of a warm start). Imports nothing heavy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

CHILD = "import sys; from pagellm.engine.core_process import main; sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))"
"""The child's program: `main` imported by the module's own name (not run as __main__), so the classes
it pickles unpickle in the front end; given the front end's pid, so a front end gone before the child even
looked is noticed."""


class EngineLaunch:
    """The child process and the front end's ends of its sockets (commands out, turns in). `env`: the child's
    environment (default: ours). `launch`: starts the child somewhere else (e.g. `ray_engine.RayEngineLauncher`)
    given the two socket addresses to connect to, returning a Popen-like handle (poll, wait, kill,
    returncode); the sockets are then TCP on all interfaces rather than ipc in a private folder."""

    def __init__(
        self,
        env: dict[str, str] | None = None,
        launch: Callable[[str, str, dict[str, str] | None], Any] | None = None,
    ):
        import zmq

        self.dir = tempfile.mkdtemp(prefix="pagellm-engine-")
        self.context = zmq.Context()
        self.commands = self.context.socket(zmq.PUSH)
        self.commands.setsockopt(zmq.LINGER, 0)
        self.turns = self.context.socket(zmq.PULL)
        self.turns.setsockopt(zmq.LINGER, 0)
        if launch is None:
            commands, turns = f"ipc://{self.dir}/commands", f"ipc://{self.dir}/turns"
            self.commands.bind(commands)
            self.turns.bind(turns)
            self.process = subprocess.Popen(
                [sys.executable, "-c", CHILD, commands, turns, str(os.getpid())], env=env
            )
        else:
            host = _host_address()
            commands = f"tcp://{host}:{self.commands.bind_to_random_port('tcp://*')}"
            turns = f"tcp://{host}:{self.turns.bind_to_random_port('tcp://*')}"
            self.process = launch(commands, turns, env)
        self.adopted = False
        """Set by the `EngineProcess` that took it over (and closes it)."""

    def discard(self) -> None:
        """Stop a launch no engine adopted (the child, waiting for its settings, is killed); nothing once
        adopted or discarded."""
        if self.adopted:
            return
        self.adopted = True
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.commands.close()
        self.turns.close()
        self.context.term()
        shutil.rmtree(self.dir, ignore_errors=True)


def _host_address() -> str:
    """This machine's address as other machines reach it (Ray's view when Ray runs, else the hostname's)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    import socket

    return socket.gethostbyname(socket.gethostname())
