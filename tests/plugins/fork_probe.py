"""A launch-like process for tests/process/test_worker_fork.py: it starts the same worker by fork
(launch/worker_fork.py) and by exec (``python -u -m tests.plugins.fork_probe train ...``, as torch's
agent starts one), and writes what each saw as JSON, for the test to compare.

``python -m tests.plugins.fork_probe MODE OUT``; MODE: state, exits, sigint, checks.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LAUNCHS_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def _handler(value: object) -> str:
    if value is None:
        return "C"
    if value is signal.default_int_handler:
        return "default_int_handler"
    if callable(value):
        return "python"
    return signal.Handlers(value).name


def _descriptor(fd: int) -> str:
    target = os.readlink(f"/proc/self/fd/{fd}")
    return target.split(":")[0] if ":" in target else target


def state() -> dict[str, Any]:
    """What a worker's code finds as it starts."""
    import logging

    import torch

    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    listed = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    fds = {fd: _descriptor(fd) for fd in listed if os.path.exists(f"/proc/self/fd/{fd}")}
    streams = {
        name: {
            "text": type(stream).__name__,
            "binary": type(stream.buffer).__name__,
            "write_through": stream.write_through,
            "line_buffering": stream.line_buffering,
            "errors": stream.errors,
            "fileno": stream.fileno(),
            "dunder": getattr(sys, f"__{name}__") is stream,
        }
        for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr))
    }
    loggers = [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values())]
    handlers = sorted(
        f"{type(h).__name__}:{getattr(getattr(h, 'stream', None), 'fileno', lambda: -1)()}"
        for lg in loggers
        if isinstance(lg, logging.Logger)
        for h in lg.handlers
    )
    return {
        "frozen": gc.get_freeze_count(),
        "handlers": {sig.name: _handler(signal.getsignal(sig)) for sig in signal.Signals},
        "mask": sorted(sig.name for sig in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "wakeup_fd": wakeup,
        "launchs_descriptors": sorted(t for fd, t in fds.items() if fd > 2 and t != os.devnull),
        "std_descriptors": [fds.get(fd) for fd in (0, 1, 2)],
        "env": dict(os.environ),
        "argv": sys.argv[1:],
        "argv0": os.path.basename(sys.argv[0]),
        "path0": sys.path[0],
        "streams": streams,
        "log_handlers": handlers,
        "torch_threads": torch.get_num_threads(),
        "threads": [t.name for t in threading.enumerate()],
        "own_session": os.getsid(0) == os.getpid(),
        "comm": Path("/proc/self/comm").read_text().strip(),
    }


def main(argv: Sequence[str]) -> int:
    """What the probe runs as the worker, forked or exec'd: ``train OUT`` writes state; ``train -c CODE``
    runs CODE as ``python -c`` would."""
    if argv[0] == "-c":
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        return 0
    Path(argv[0]).write_text(json.dumps(state()))
    return 0


class ProbeWorker:
    """The worker_fork.Worker the launch-like process forks."""

    @staticmethod
    def preload() -> None:
        pass

    @staticmethod
    def run(argv: Sequence[str]) -> int:
        return main(argv)


def as_launch() -> tuple[int, list[Any]]:
    """Set this process up as launch is while its agent runs: torch loaded, python handlers on the stop
    signals, a wakeup fd, a listening socket, an open file, a thread, a stream log handler. Returns
    torch's thread count before launch went to one thread, and what must stay alive."""
    import logging

    import torch

    for sig in LAUNCHS_SIGNALS:
        signal.signal(sig, lambda signum, frame: None)
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    listening = socket.create_server(("127.0.0.1", 0))
    kept = open(__file__)  # noqa: SIM115
    threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="agent-thread").start()
    logging.getLogger("torch.distributed.elastic").addHandler(logging.StreamHandler())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads, [wake_r, wake_w, listening, kept]


def exec_worker(args: Sequence[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """As torch's SubprocessHandler starts a worker."""
    cmd = [sys.executable, "-u", "-m", "tests.plugins.fork_probe", "train", *args]
    return subprocess.Popen(cmd, env=env, start_new_session=True, **kwargs)


def run_state(out: Path) -> None:
    from ddpjob.launch import worker_fork

    threads, _kept = as_launch()
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    env.pop("OMP_NUM_THREADS", None)
    forked = worker_fork.start(ProbeWorker(), [str(out / "fork.json")], env, None, None, threads)
    assert forked.wait(60) == 0
    assert exec_worker([str(out / "exec.json")], env).wait(60) == 0


EXIT_ROWS = {  # what the worker's code does: both ways must end the same
    "returns": "pass",
    "exit 3": "raise SystemExit(3)",
    "exit None": "raise SystemExit(None)",
    "exit text": "raise SystemExit('bye')",
    "exit 300": "import sys; sys.exit(300)",
    "error": "raise ValueError('bad')",
    "interrupted": "raise KeyboardInterrupt",
    "killed": "import os, signal; os.kill(os.getpid(), signal.SIGTERM); import time; time.sleep(5)",
    "thread then atexit": (
        "import atexit, threading, time; atexit.register(print, 'atexit', flush=True); "
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread', flush=True))).start()"
    ),
    "C's stdout": "import ctypes; ctypes.CDLL(None).printf(b'from C\\n'); print('from python')",
    "daemonic child": (
        "import multiprocessing as mp, time; p = mp.get_context('fork').Process(target=time.sleep, args=(60,), "
        "daemon=True); p.start(); open(__import__('os').environ['CHILD_PID'], 'w').write(str(p.pid))"
    ),
}


def run_exits(out: Path) -> None:
    from ddpjob.launch import worker_fork

    threads, _kept = as_launch()
    results: dict[str, Any] = {}
    for name, code in EXIT_ROWS.items():
        row: dict[str, Any] = {}
        for how in ("fork", "exec"):
            stdout, stderr = out / f"{name}-{how}.out", out / f"{name}-{how}.err"
            env = {**os.environ, "RANK": "0", "CHILD_PID": str(out / f"{name}-{how}.child")}
            with open(stdout, "w") as o, open(stderr, "w") as e:
                if how == "fork":
                    proc: Any = worker_fork.start(ProbeWorker(), ["-c", code], env, o, e, threads)
                else:
                    proc = exec_worker(["-c", code], env, stdout=o, stderr=e)
                status = proc.wait(60)
            child = out / f"{name}-{how}.child"
            child_alive = child.exists() and Path(f"/proc/{child.read_text()}").exists()
            lines = stderr.read_text().strip().splitlines()
            row[how] = [status, stdout.read_text(), lines[-1] if lines else "", child_alive]
        results[name] = row
    (out / "exits.json").write_text(json.dumps(results))


def run_sigint(out: Path, starts: int = 20) -> None:
    """SIGINT the moment a worker has started (a Ctrl-C as launch starts its workers)."""
    from ddpjob.launch import worker_fork

    threads, _kept = as_launch()
    codes = []
    for _ in range(starts):
        forked = worker_fork.start(
            ProbeWorker(), ["-c", "import time; time.sleep(30)"], dict(os.environ), None, None, threads
        )
        os.kill(forked.pid, signal.SIGINT)
        codes.append(forked.wait(60))
    (out / "sigint.json").write_text(json.dumps(codes))


class UsersError(Exception):
    """An error class of the user's (in the check, its module may not be importable in launch)."""


def _raise_users_error() -> None:
    raise UsersError("the user's data is missing")


def _leave_a_process() -> int:
    if os.fork() == 0:  # a process of the check's own that outlives it, holding the answer's pipe open
        null = os.open(os.devnull, os.O_WRONLY)  # (not the probe's output, which the test reads to its end)
        os.dup2(null, 1)
        os.dup2(null, 2)
        time.sleep(30)
        os._exit(0)
    return 7


def run_checks(out: Path) -> None:
    from ddpjob.checkpoint import storage
    from ddpjob.errors import UsageError
    from ddpjob.launch import worker_fork

    def check(name: str, fn: Any) -> dict[str, Any]:
        began = time.monotonic()
        try:
            value = worker_fork.checked_apart(fn)
            got: dict[str, Any] = {"value": repr(value)}
        except BaseException as exc:
            got = {"error": type(exc).__name__, "message": str(exc), "notes": getattr(exc, "__notes__", [])}
        got["seconds"] = time.monotonic() - began
        return got

    def raise_usage() -> None:
        raise UsageError("--data is bad")

    def import_a_module() -> bool:
        import colorsys  # noqa: F401 - any module launch has not imported

        return "colorsys" in sys.modules

    storage.fsspec_storage("memory://bucket")

    def exits_2() -> None:
        raise SystemExit(2)  # a plug-in's own argparse, as it is imported

    results = {
        "value": check("value", lambda: {"plan": 42}),
        "exit 2": check("exit 2", exits_2),
        "ddpjob error": check("ddpjob error", raise_usage),
        "user's error": check("user's error", _raise_users_error),
        "unpicklable value": check("unpicklable value", lambda: lambda: 0),
        "died": check("died", lambda: os._exit(3)),
        "left a process": check("left a process", _leave_a_process),
        "imports": check("imports", import_a_module),
        "stores": check("stores", lambda: len(storage._STORES)),
    }
    results["launch imported"] = {"value": repr("colorsys" in sys.modules)}
    results["launch's stores"] = {"value": repr(len(storage._STORES))}
    (out / "checks.json").write_text(json.dumps(results))


if __name__ == "__main__":
    mode, target = sys.argv[1], sys.argv[2:]
    if mode == "train":
        raise SystemExit(main(target))
    {"state": run_state, "exits": run_exits, "sigint": run_sigint, "checks": run_checks}[mode](Path(target[0]))
