"""Paths and helpers shared by the end-to-end tests."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("E2E_STATE", REPO / ".e2e"))
IMAGE = "ddpjob:cpu"


def wait_for(check: Callable[[], object], timeout: float, what: str, every: float = 1.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
