"""Worker log lines that say where they come from.

Every line a worker writes to stdout/stderr is prefixed with ``[node N rank R]`` (the heartbeat
that shows a stuck rank is watchdog.start_watchdog's). Lines from several threads (the loop, the
heartbeat, a tracker) come out whole and prefixed, and a forked child (a data loader worker)
starts with a stream of its own.
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

    Each thread's text is held until its line ends (``print`` writes a line and its newline apart)
    or the stream is flushed, then written with its prefix in one write under a lock: a thread
    that found itself mid-line could otherwise write its own line unprefixed and have it land
    first. The lock is reentrant: a stop signal's handler logs on the main thread, which may be
    inside a write already.
    """

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self.stream, self.prefix = stream, prefix
        self._fresh()
        _streams.add(self)

    def _fresh(self) -> None:
        self.lock = threading.RLock()
        self.at_line_start = True
        self.pending: dict[int, str] = {}  # thread id -> the text of its unfinished line

    def _emit(self, text: str) -> None:
        out = []
        for piece in text.splitlines(keepends=True):
            if self.at_line_start:
                out.append(self.prefix)
            out.append(piece)
            self.at_line_start = piece.endswith("\n")
        self.stream.write("".join(out))

    def write(self, text: str) -> int:
        with self.lock:
            me = threading.get_ident()
            held = self.pending.pop(me, "") + text
            end = held.rfind("\n") + 1
            if end:
                self._emit(held[:end])
            if held[end:]:
                self.pending[me] = held[end:]
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        """Write this thread's unfinished line as it stands (a progress bar, a prompt), and those of
        threads that have ended, then flush. Not another live thread's: print may be between its
        text and its newline."""
        with self.lock:
            me, live = threading.get_ident(), {t.ident for t in threading.enumerate()}
            for ident in [me, *(i for i in self.pending if i not in live)]:
                if ident in self.pending:
                    self._emit(self.pending.pop(ident))
            self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding ...
        return getattr(self.stream, name)


def _after_fork_in_child() -> None:
    """A child forked while another thread held a stream's lock would hang at its first line."""
    for stream in list(_streams):
        stream._fresh()


os.register_at_fork(after_in_child=_after_fork_in_child)


def prefix_output(env: DistEnv) -> None:
    prefix = f"[node {env.node_rank} rank {env.rank}] "
    sys.stdout = PrefixedStream(sys.stdout, prefix)  # type: ignore[assignment,unused-ignore]
    sys.stderr = PrefixedStream(sys.stderr, prefix)  # type: ignore[assignment,unused-ignore]
