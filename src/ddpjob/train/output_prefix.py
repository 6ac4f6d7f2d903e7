"""Worker log lines that say where they come from.

Every line a worker writes to stdout/stderr is prefixed with ``[node N rank R]`` (the heartbeat
that shows a stuck rank is watchdog.start_watchdog's), whichever thread writes it, and a forked
child (a data loader worker) starts with a stream of its own.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any, TextIO

from ddpjob.distenv import DistEnv

_streams: weakref.WeakSet[PrefixedStream] = weakref.WeakSet()


class PrefixedStream:
    """A text stream that starts every line with a fixed prefix, safe to write from several threads.

    The choice of prefix and the write to the stream it wraps happen under one lock: otherwise a
    thread could find itself mid-line (another thread's line begun but not yet written), write its
    own line without a prefix and have it land first. Text is written at once, never held: a
    worker's last words before a hang or an ``os._exit`` are what tell what it was doing. (So two
    threads' ``print``s can share a line, as with any stream; ddpjob's own lines are one write each.)
    The lock is reentrant: a stop signal's handler logs on the main thread, which may be inside a
    write already.
    """

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self.stream, self.prefix = stream, prefix
        self._fresh()
        _streams.add(self)

    def _fresh(self) -> None:
        self.lock, self.at_line_start = threading.RLock(), True

    def write(self, text: str) -> int:
        with self.lock:
            out, at_start = [], self.at_line_start
            for piece in text.splitlines(keepends=True):
                if at_start:
                    out.append(self.prefix)
                out.append(piece)
                at_start = piece.endswith("\n")
            self.stream.write("".join(out))
            self.at_line_start = at_start  # after the write: a handler's line written inside it gets its prefix
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding ...
        return getattr(self.stream, name)


def _after_fork_in_child() -> None:
    """A child forked while another thread held a stream's lock would hang at its first line, and
    one forked mid-line would write its first line unprefixed."""
    for stream in list(_streams):
        stream._fresh()


os.register_at_fork(after_in_child=_after_fork_in_child)


def prefix_output(env: DistEnv) -> None:
    prefix = f"[node {env.node_rank} rank {env.rank}] "
    sys.stdout = PrefixedStream(sys.stdout, prefix)  # type: ignore[assignment,unused-ignore]
    sys.stderr = PrefixedStream(sys.stderr, prefix)  # type: ignore[assignment,unused-ignore]
