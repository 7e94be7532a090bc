"""`pytest --device` (or PAGELLM_DEVICE) is the one switch for the device a test session runs on, and cpu
when neither is given: on a GPU machine the suite would otherwise run its engines on CUDA (auto) against
references on the CPU. Each case runs a session of one test with tests/conftest.py, in this process."""

from __future__ import annotations

from pathlib import Path

import pytest

import pagellm  # noqa: F401 (imported here, not by each inner session: pytester unloads what a session imports)

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).parent / "conftest.py"
SESSION_TEST = """
import os

import pytest

from pagellm import LLM
from pagellm.core.errors import DeviceUnavailableError


def test_the_session_device_reaches_llm():
    assert os.environ["PAGELLM_DEVICE"] == {device!r}
    if {device!r} != "cpu":
        with pytest.raises(DeviceUnavailableError, match="Device '{device}' is not a registered platform"):
            LLM("no-model-is-read-before-the-device-is-chosen")
"""


@pytest.mark.parametrize(
    ("option", "variable", "device"),
    [
        (None, None, "cpu"),  # neither: cpu, not auto
        ("nosuch", None, "nosuch"),
        (None, "nosuch", "nosuch"),
        ("nosuch", "cpu", "nosuch"),  # the option wins over the variable
    ],
)
def test_the_option_or_variable_sets_the_session_device(pytester, monkeypatch, option, variable, device):
    if variable is None:
        monkeypatch.delenv("PAGELLM_DEVICE", raising=False)
    else:
        monkeypatch.setenv("PAGELLM_DEVICE", variable)  # monkeypatch restores this session's value after
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(SESSION_TEST.format(device=device))
    result = pytester.runpytest_inprocess(*(["--device", option] if option else []))
    result.assert_outcomes(passed=1)
