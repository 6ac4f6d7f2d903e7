"""Test plug-in: the digits model, its module noting each process that imports it (pid, parent, RANK)
as one JSON file in TEST_IMPORTS_DIR: which processes ran the user's code."""

import json
import os
from pathlib import Path

from ddpjob.plugins import digits_mlp

__all__ = ["digits_mlp"]

_seen = {"pid": os.getpid(), "parent": os.getppid(), "rank": os.environ.get("RANK")}
(Path(os.environ["TEST_IMPORTS_DIR"]) / f"{os.getpid()}.json").write_text(json.dumps(_seen))
