"""Paths and helpers shared by the end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("E2E_STATE", REPO / ".e2e"))
# E2E_IMAGE: another tag of the image (a branch's build beside the engine's ddpjob:cpu); the compose
# files get it as DDPJOB_IMAGE in their environment (conftest's docker_env).
IMAGE = os.environ.get("E2E_IMAGE", "ddpjob:cpu")


def wait_for(check: Callable[[], object], timeout: float, what: str, every: float = 1.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def volume_dir(docker_env: dict[str, str], volume: str) -> Path | None:
    """Where the engine keeps a volume on this host (the tests run as root beside dockerd)."""
    out = subprocess.run(
        ["docker", "volume", "inspect", "-f", "{{.Mountpoint}}", volume], env=docker_env, capture_output=True, text=True
    )
    return Path(out.stdout.strip()) if out.returncode == 0 else None


def jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (metrics.jsonl, attempts.jsonl); [] while there is none."""
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
