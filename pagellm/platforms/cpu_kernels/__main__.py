"""`python -m pagellm.platforms.cpu_kernels`: build the kernels into the cache and exit (0: built), as
`build_in_background` runs it: niced, and in a process group of its own that it ends (ninja and the
compilers with it) when the process that started it is gone, so a stopped server leaves no build behind."""

import logging
import os
import signal
import sys
import threading
import time

from pagellm.platforms import cpu_kernels


def _end_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.killpg(0, signal.SIGTERM)  # ninja ends its compilers (in groups of their own) on SIGTERM

    threading.Thread(target=watch, daemon=True).start()


os.nice(10)
if os.getpgrp() == os.getpid():  # started as a group's leader: the group is this build's alone
    _end_with_parent()
logging.basicConfig(level=logging.INFO, format="%(asctime)s kernels %(message)s")
logging.getLogger("pagellm").setLevel(logging.DEBUG)  # a failed build's compiler output, into the log
if cpu_kernels.load() is None:
    print(cpu_kernels.why_unavailable(), file=sys.stderr)  # the last line: the reason the engine logs
    sys.exit(1)
