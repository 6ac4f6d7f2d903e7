"""train.output_prefix: every line a worker writes starts with its node and rank, whatever thread wrote it."""

from __future__ import annotations

import io
import sys
import threading

from ddpjob import log
from ddpjob.train.output_prefix import PrefixedStream

PREFIX = "[node 0 rank 1] "


def test_a_line_split_over_writes_gets_one_prefix_and_the_next_line_its_own():
    sink = io.StringIO()
    stream = PrefixedStream(sink, PREFIX)
    for text in ("a", "b\nc", "\n", "\r\n", "d\n"):
        stream.write(text)
    assert sink.getvalue() == f"{PREFIX}ab\n{PREFIX}c\n{PREFIX}\r\n{PREFIX}d\n"


def test_lines_written_from_many_threads_at_once_all_start_with_the_prefix(monkeypatch):
    """The heartbeat thread logs while the loop prints: without the stream's lock a thread could
    decide mid-line that no prefix is due and have its line land first, unprefixed."""
    sink = io.StringIO()
    stream = PrefixedStream(sink, PREFIX)
    monkeypatch.setattr(sys, "stdout", stream)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows

    def writer(n: int) -> None:
        for i in range(2000):
            if i % 2:
                log.info(f"heartbeat {n} {i}")  # one write per line
            else:
                print(f"[ddpjob] step {n} {i}")  # print: the text, then its newline

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    lines = sink.getvalue().splitlines()
    assert [ln for ln in lines if not ln.startswith(PREFIX)] == []
    assert sum(ln.count("[ddpjob]") for ln in lines) == 4 * 2000  # nothing lost


def test_text_is_written_at_once_and_the_end_of_its_line_gets_no_second_prefix():
    """A worker's last words before a hang or an os._exit must be out, newline or not."""
    sink = io.StringIO()
    stream = PrefixedStream(sink, PREFIX)
    stream.write("loading shard 3 ... ")
    assert sink.getvalue() == f"{PREFIX}loading shard 3 ... "
    stream.writelines(["done\nnext", " line\n"])
    assert sink.getvalue() == f"{PREFIX}loading shard 3 ... done\n{PREFIX}next line\n"


def test_a_write_made_while_the_same_thread_is_inside_one_completes():
    """A stop signal's handler logs on the main thread, which may be inside a write already: with a
    lock that is not reentrant, the job would hang there instead of stopping."""

    class Reentering(io.StringIO):
        def write(self, text: str) -> int:
            if "step" in text:
                stream.write("got SIGTERM\n")  # the handler, run between two bytecodes of this write
            return super().write(text)

    sink = Reentering()
    stream = PrefixedStream(sink, PREFIX)
    writer = threading.Thread(target=stream.write, args=("step 5\n",), daemon=True)
    writer.start()
    writer.join(timeout=10)
    assert not writer.is_alive(), "the nested write never returned"
    assert sink.getvalue().splitlines() == [f"{PREFIX}got SIGTERM", f"{PREFIX}step 5"]
