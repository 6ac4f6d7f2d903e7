"""Console output, in one place: the ``[ddpjob]`` prefix, the level word and the stream of each level.

- ``info``: what the job is doing (stdout).
- ``warning``: something is off and the job goes on (stderr, ``[ddpjob] warning: ...``).
- ``failure``: why this process or node stops, or a worker's last word (stderr).

Bad input is not logged here: ``errors.run_guarded`` prints its one line, ``ddpjob: error: ...``, and
exits 2. On a worker, train.output_prefix puts ``[node N rank R]`` before every line of both streams.
"""

from __future__ import annotations

import sys

PREFIX = "[ddpjob]"


def info(message: str) -> None:
    print(f"{PREFIX} {message}", flush=True)


def warning(message: str) -> None:
    print(f"{PREFIX} warning: {message}", file=sys.stderr, flush=True)


def failure(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)
