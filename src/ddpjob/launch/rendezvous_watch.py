"""Who has joined the rendezvous: read while torchrun waits, reported if it times out.

torchrun's rendezvous timeout says only that it timed out. ``RendezvousWatch`` reads the c10d
rendezvous state (``torch.rendezvous.<id>`` in node 0's store, base64 of a pickle) in a background
thread of ``ddpjob launch``, so the failure can say "at least 2 of 3 nodes joined (node-a, node-b)".
The pickle is decoded by an unpickler that builds only inert records, datetimes and sets: nothing
from the network can run code.

The count is a lower bound of node slots, and says so: every node that any read found, not only the
last read, and never more than the job has. A node's agent that restarted (a new pid) is the same node,
so nodes are counted per host: the most that one read showed on that host together (several nodes
may share a host, as on localhost), summed over hosts, at most the job's node count. What it
cannot tell: nodes seen at different times count together (one that left at its own timeout and one
that came later), and an agent restarted within torch's heartbeat expiry (15 s) has its old entry
beside the new one in the same read, so that host counts one node more from such a read on.
Each node leaves the state at its own join timeout, and node 0, whose store holds the state, takes
the store with it: when it joined first it leaves first, and a read between its leaving and its
store's end sees fewer nodes than joined (a count of only the last read said "1 of 3" where two had
joined). A node that joins after the last read is not seen at all. Reads start one period after
launch (1 s up to 32 nodes, then nnodes/32 s, so the store gets at most 32 reads a second; sooner
if the timeout is shorter) and stop at the first complete rendezvous: nodes that start together
cost a read or two.

Every read runs in a daemon thread, never on launch's main thread: torch's TCPStore connect ignores
its timeout against a host that accepts a connection but never answers (blocked for minutes), so
``summary()`` waits a bounded time for its read and otherwise says the store did not answer.
"""

from __future__ import annotations

import base64
import datetime
import io
import pickle
import socket
import threading
from collections import Counter
from dataclasses import dataclass

from ddpjob.errors import first_line

_STATE_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_NULL_SENTINEL = b"Y2FuaW1hZGFt"  # what the c10d backend stores before the first node writes
_READ_TIMEOUT_S = 5.0
_SUMMARY_READ_S = 2.0  # summary()'s own read, when no read had finished before the failure


class _Record:
    """Stand-in for torch's ``_RendezvousState`` and ``_NodeDesc``: attributes only."""

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        if module == _STATE_MODULE and name in ("_RendezvousState", "_NodeDesc"):
            return _Record
        if module == "datetime" and name in ("datetime", "timezone", "timedelta"):
            return getattr(datetime, name)
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in rendezvous state")


Node = tuple[str, int, int]  # torch's node identity: host, process id, local id


@dataclass(frozen=True)
class Joined:
    """The nodes present in the rendezvous state, and whether the round is complete."""

    nodes: frozenset[Node]
    complete: bool


def decode_state(raw: bytes) -> Joined:
    """Parse the stored value; the sentinel (nobody has written yet) means nobody joined."""
    if raw == _NULL_SENTINEL:
        return Joined(frozenset(), False)
    state = _StateUnpickler(io.BytesIO(base64.b64decode(raw))).load()
    nodes = [*state.participants, *state.wait_list]
    found = {(str(getattr(n, "addr", "?")), int(getattr(n, "pid", 0)), int(getattr(n, "local_id", 0))) for n in nodes}
    return Joined(frozenset(found), bool(state.complete))


class RendezvousWatch:
    """Poll node 0's store for the rendezvous state of ``run_id`` until it completes."""

    def __init__(self, endpoint: str, run_id: str, nnodes: int, timeout_s: float) -> None:
        self.endpoint, self.run_id, self.nnodes = endpoint, run_id, nnodes
        self.period_s = max(1.0, nnodes / 32)  # large jobs: keep the host store's load small
        self.first_read_s = min(self.period_s, timeout_s / 2)  # a short timeout gets a read before it
        self.most: dict[str, int] = {}  # per host, the most nodes one read found there (those that left too)
        self.read = False  # whether any read succeeded
        self.complete = False
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpjob-rdzv-watch", daemon=True)

    def __enter__(self) -> RendezvousWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=_READ_TIMEOUT_S)  # launch must not exit with a read under way (_read)

    def _run(self) -> None:
        wait_s = self.first_read_s
        while not self._stop.wait(wait_s) and not self.complete:
            self.poll(timeout_s=_READ_TIMEOUT_S)
            wait_s = self.period_s

    def poll(self, timeout_s: float) -> None:
        """Read the state once and add the nodes it holds to ``seen``."""
        try:
            joined = self._read(timeout_s)
        except Exception as exc:  # unreachable store or a foreign value: say so on failure
            self.error = f"{type(exc).__name__}: {first_line(exc)}"
            return
        here = Counter(host for host, _, _ in joined.nodes)
        self.most = {host: max(self.most.get(host, 0), here[host]) for host in {*self.most, *here}}  # one assignment
        self.read, self.error = True, ""
        self.complete = joined.complete and len(joined.nodes) >= self.nnodes

    def _read(self, timeout_s: float) -> Joined:
        from torch.distributed import TCPStore

        host, port = self.endpoint.rsplit(":", 1)
        host = host.strip("[]")
        # TCPStore retries a refused connection with back-off, for longer than its timeout, in C++
        # code; if that call returns while the interpreter shuts down, the process aborts (SIGABRT,
        # exit 134 instead of launch's own code). So only a port that accepts a connection gets one.
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        timeout = datetime.timedelta(seconds=timeout_s)
        store = TCPStore(host, int(port), is_master=False, timeout=timeout)
        key = "torch.rendezvous." + self.run_id
        return decode_state(store.get(key)) if store.check([key]) else Joined(frozenset(), False)

    def summary(self) -> str:
        """One clause for the failure message: how many nodes at least joined, or why that is unknown."""
        if not self.read and not self.error:  # failed before the first read: read once now, in a thread
            reader = threading.Thread(target=self.poll, args=(_SUMMARY_READ_S,), name="ddpjob-rdzv-read", daemon=True)
            reader.start()
            reader.join(timeout=2 * _SUMMARY_READ_S)
            if reader.is_alive():
                return (
                    f"no count of joined nodes: the store at {self.endpoint} accepted a connection but "
                    f"did not answer within {2 * _SUMMARY_READ_S:g} s"
                )
        if self.read:
            most = self.most
            count = min(sum(most.values()), self.nnodes)
            if not count:
                return f"no node of the {self.nnodes} was seen to join"
            hosts = sorted(most)
            names = ", ".join(hosts[:8]) + (f" and {len(hosts) - 8} more" if len(hosts) > 8 else "")
            return f"at least {count} of {self.nnodes} nodes joined ({names})"
        return f"no count of joined nodes: reading the state from {self.endpoint} failed ({self.error})"
