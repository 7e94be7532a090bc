"""Shared test set-up: tests/models/tiny.py (tiny random checkpoints) is importable as `tiny` everywhere."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "models"))
