"""Shared test set-up: the helpers in tests/models (`tiny` checkpoints, the `parity` oracle) import everywhere."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "models"))
