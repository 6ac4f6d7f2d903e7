"""Worker log lines that say where they come from.

Every line a worker writes to stdout/stderr is prefixed with ``[node N rank R]`` (the heartbeat
that shows a stuck rank is watchdog.start_watchdog's). Threads write through one lock per stream,
so that the heartbeat thread and the loop cannot leave a line without its prefix.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

from ddpjob.distenv import DistEnv


class PrefixedStream:
    """A text stream that starts every line with a fixed prefix, safe to write from several threads.

    The choice of prefix and the write to the stream it wraps happen under one lock: otherwise a
    thread could find itself mid-line (another thread's line begun but not yet written), write its
    own line without a prefix and have it land first. The lock is reentrant: a stop signal's
    handler logs a line on the main thread, which may be inside a write already.
    """

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self.stream, self.prefix, self.at_line_start = stream, prefix, True
        self.lock = threading.RLock()

    def write(self, text: str) -> int:
        with self.lock:
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
