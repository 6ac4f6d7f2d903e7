"""train.output_prefix across a fork: a data loader worker forked while another thread writes.

(The test of test_output_prefix.py that starts a process.)
"""

from __future__ import annotations

import io
import os
import signal
import threading
import time

from ddpjob.train.output_prefix import PrefixedStream

PREFIX = "[node 0 rank 1] "


def test_a_child_forked_while_another_thread_holds_the_lock_can_still_write():
    """A data loader worker forks while the heartbeat thread writes: the child must not inherit a
    lock that no thread of its own will ever release."""
    sink = io.StringIO()
    stream = PrefixedStream(sink, PREFIX)
    stream.write("the parent's unfinished line")
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with stream.lock:
            held.set()
            release.wait()

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    held.wait()
    pid = os.fork()
    if pid == 0:  # the child: a line of its own, alone and prefixed, or exit 1 (a hang: killed below)
        stream.write("child\n")
        os._exit(0 if sink.getvalue().endswith(f"unfinished line{PREFIX}child\n") else 1)  # its own line, prefixed
    release.set()
    thread.join()
    deadline = time.monotonic() + 10
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    if done == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done != (0, 0), "the child hung on the lock"
    assert os.waitstatus_to_exitcode(done[1]) == 0
