"""Worker log lines that say where they come from, and a heartbeat that shows a stuck rank.

Every line a worker writes to stdout/stderr is prefixed with ``[node N rank R]``. With
``--heartbeat S`` each rank also reports its step every S seconds from a background thread, so
a rank that hangs (in a collective, in I/O) keeps saying so, and for how long.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from ddpjob.distenv import DistEnv


class PrefixedStream:
    """A text stream that starts every line with a fixed prefix."""

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self.stream, self.prefix, self.at_line_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self.at_line_start:
                out.append(self.prefix)
            out.append(piece)
            self.at_line_start = piece.endswith("\n")
        self.stream.write("".join(out))
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding ...
        return getattr(self.stream, name)


def prefix_output(env: DistEnv) -> None:
    prefix = f"[node {env.node_rank} rank {env.rank}] "
    sys.stdout = PrefixedStream(sys.stdout, prefix)  # type: ignore[assignment,unused-ignore]
    sys.stderr = PrefixedStream(sys.stderr, prefix)  # type: ignore[assignment,unused-ignore]


def start_heartbeat(every: float, current_step: Callable[[], int]) -> threading.Event:
    """Print this rank's step every `every` seconds until the returned event is set."""
    stop = threading.Event()

    def beat() -> None:
        last_step, since = current_step(), time.monotonic()
        while not stop.wait(every):
            step = current_step()
            if step != last_step:
                last_step, since = step, time.monotonic()
            print(f"[ddpjob] heartbeat: step {step}, no progress for {time.monotonic() - since:.0f}s", flush=True)

    threading.Thread(target=beat, name="ddpjob-heartbeat", daemon=True).start()
    return stop
