"""Console output, in one place: the ``[ddpjob]`` prefix, the level word and the stream of each level.

- ``info``: what the job is doing (stdout).
- ``warning``: something is off and the job goes on (stderr, ``[ddpjob] warning: ...``).
- ``failure``: why this process or node stops, or a worker's last word (stderr).

Bad input is not logged here: ``errors.run_guarded`` prints its one line, ``ddpjob: error: ...``, and
exits 2. On a worker, train.output_prefix puts ``[node N rank R]`` before every line of both streams.
"""

from __future__ import annotations

import sys
from typing import TextIO

PREFIX = "[ddpjob]"


def _line(stream: TextIO | None, text: str) -> None:
    """One write per line (print writes the text and its newline apart, and another thread's line
    could land between them), then flush; nothing where the stream is closed (None), as print."""
    if stream is None:
        return
    stream.write(f"{PREFIX} {text}\n")
    stream.flush()


def info(message: str) -> None:
    _line(sys.stdout, message)


def warning(message: str) -> None:
    _line(sys.stderr, f"warning: {message}")


def failure(message: str) -> None:
    _line(sys.stderr, message)
