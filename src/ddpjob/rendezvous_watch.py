"""Who has joined the rendezvous: read while torchrun waits, reported if it times out.

torchrun's rendezvous timeout says only that it timed out. ``RendezvousWatch`` reads the c10d
rendezvous state (``torch.rendezvous.<id>`` in node 0's store, base64 of a pickle) in a background
thread of ``ddpjob launch`` and keeps the last count and host names it saw, so the failure can say
"1 of 2 nodes joined (node-a)". The pickle is decoded by an unpickler that builds only inert
records, datetimes and sets: nothing from the network can run code. Reads start at half the
rendezvous timeout and stop at the first complete rendezvous, so a healthy start costs nothing.
"""

from __future__ import annotations

import base64
import datetime
import io
import pickle
import threading
from dataclasses import dataclass

from ddpjob.errors import first_line

_STATE_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_NULL_SENTINEL = b"Y2FuaW1hZGFt"  # what the c10d backend stores before the first node writes


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


@dataclass(frozen=True)
class Joined:
    """Distinct nodes present in the rendezvous, and whether the round is complete."""

    hosts: tuple[str, ...]
    complete: bool


def decode_state(raw: bytes) -> Joined:
    """Parse the stored value; the sentinel (nobody has written yet) means nobody joined."""
    if raw == _NULL_SENTINEL:
        return Joined((), False)
    state = _StateUnpickler(io.BytesIO(base64.b64decode(raw))).load()
    nodes = [*state.participants, *state.wait_list]
    return Joined(tuple(sorted(getattr(n, "addr", "?") for n in nodes)), bool(state.complete))


class RendezvousWatch:
    """Poll node 0's store for the rendezvous state of ``run_id`` until it completes."""

    def __init__(self, endpoint: str, run_id: str, nnodes: int, timeout_s: float) -> None:
        self.endpoint, self.run_id, self.nnodes = endpoint, run_id, nnodes
        self.first_read_s = timeout_s / 2
        self.period_s = max(1.0, nnodes / 32)  # large jobs: keep the host store's load small
        self.last: Joined | None = None
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpjob-rdzv-watch", daemon=True)

    def __enter__(self) -> RendezvousWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _run(self) -> None:
        if self._stop.wait(self.first_read_s):
            return
        while not self._stop.is_set():
            self._poll(timeout_s=5)
            if self.last and self.last.complete and len(self.last.hosts) >= self.nnodes:
                return
            self._stop.wait(self.period_s)

    def _poll(self, timeout_s: float) -> None:
        try:
            self.last, self.error = self._read(timeout_s), ""
        except Exception as exc:  # unreachable store or a foreign value: say so on failure
            self.error = f"{type(exc).__name__}: {first_line(exc)}"

    def _read(self, timeout_s: float) -> Joined:
        from torch.distributed import TCPStore

        host, port = self.endpoint.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timeout)
        key = "torch.rendezvous." + self.run_id
        return decode_state(store.get(key)) if store.check([key]) else Joined((), False)

    def summary(self) -> str:
        """One clause for the failure message: how many nodes joined, or why that is unknown."""
        if self.last is None and not self.error:  # failed before the first read: read once now
            self._poll(timeout_s=2)
        if self.last is not None:
            hosts = self.last.hosts
            names = ", ".join(hosts[:8]) + (f" and {len(hosts) - 8} more" if len(hosts) > 8 else "")
            return f"{len(hosts)} of {self.nnodes} nodes joined" + (f" ({names})" if hosts else "")
        return f"no count of joined nodes: reading the state from {self.endpoint} failed ({self.error})"
