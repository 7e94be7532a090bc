"""What a user installing the wheel gets: the native kernels' sources, which are built on first use."""

import subprocess
import sys
import zipfile
from pathlib import Path

from pagellm.platforms import cpu_kernels

ROOT = Path(__file__).parent.parent


def test_the_wheel_ships_the_kernel_sources(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            tmp_path,
            ROOT,
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("pagellm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in cpu_kernels.SOURCES + cpu_kernels.HEADERS:
        assert f"pagellm/platforms/cpu_kernels/{name}" in names
