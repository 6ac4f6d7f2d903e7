"""Test plug-ins for tests/process/test_starter.py: model factories that record the state of the
process they are called in (``state``), or end it in one of python's ways (``ending``), so that a
command forked from the starter can be compared with an exec'd one."""

from __future__ import annotations

import atexit
import json
import os
import random
import signal
import sys
import threading
import time
from typing import Any

from torch import nn

from ddpjob import plugins


def _draws() -> list[float]:
    import numpy
    import torch

    return [random.random(), float(numpy.random.random()), torch.rand(()).item()]


_DRAWS = _draws()


def _descriptor(fd: int) -> str:
    target = os.readlink(f"/proc/self/fd/{fd}")
    return target.split(":")[0] if ":" in target else target  # pipe:[123] -> pipe


def _state() -> dict[str, Any]:
    import torch

    main = sys.modules["__main__"]
    _test = int(os.environ["TEST_PID"])
    handlers = {}
    for sig in sorted(signal.valid_signals()):
        handler = signal.getsignal(sig)
        handlers[str(sig)] = signal.Handlers(handler).name if isinstance(handler, int) else handler.__name__
    open_fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    return {
        "argv": sys.argv,
        "main": [main.__spec__.name if main.__spec__ else None, os.path.basename(getattr(main, "__file__", ""))],
        "path": sys.path,
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
        "handlers": handlers,
        "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "wakeup_fd": signal.set_wakeup_fd(-1),
        "stdio": [_descriptor(fd) for fd in (0, 1, 2)],
        # what a fork leaves open beyond stdio is /dev/null (worker_fork._quiet_launchs_descriptors)
        "others": sorted(
            {_descriptor(fd) for fd in open_fds[3:] if os.path.exists(f"/proc/self/fd/{fd}")} - {"/dev/null"}
        ),
        "streams": [[s.line_buffering, s.write_through, s.encoding, s.errors] for s in (sys.stdout, sys.stderr)],
        "threads": [threading.active_count(), len(os.listdir("/proc/self/task"))],
        "torch_threads": [torch.get_num_threads(), torch.get_num_interop_threads()],
        "session": [os.getsid(0) == os.getsid(_test), os.getpgrp() == os.getpgid(_test)],  # the test's
        "umask": os.umask(0o22),
        "flags": list(sys.flags),
        "warnoptions": sys.warnoptions,
        "draws": _DRAWS,  # as this module was imported, before ddpjob seeds anything
        "hash": hash("ddpjob"),
        "forked": forked(),
    }


def state(out: str) -> Any:
    """A data factory (called before ddpjob handles any signal) that writes this process's state to
    ``out`` (JSON); the digits data."""
    with open(out, "w") as f:
        json.dump(_state(), f)
    return plugins.digits()


def _late_thread() -> None:
    time.sleep(0.3)
    print("thread ended", flush=True)


ENDINGS = {  # how -> (what the factory does, the exit code python gives it)
    "exit_3": (lambda: sys.exit(3), None),  # ddpjob's own handling of it: the same either way
    "os_exit_4": (lambda: os._exit(4), 4),
    "SIGTERM": (lambda: os.kill(os.getpid(), signal.SIGTERM), -signal.SIGTERM),
    "SIGKILL": (lambda: os.kill(os.getpid(), signal.SIGKILL), -signal.SIGKILL),
    "abort": (os.abort, -signal.SIGABRT),
    "KeyboardInterrupt": (lambda: os.kill(os.getpid(), signal.SIGINT), None),
    "exit_message": (lambda: sys.exit("a message to end with"), None),
    # written last, into stdout's buffer (a pipe's: held until a flush), which only the exit flushes
    "unflushed_at_exit": (lambda: (atexit.register(sys.stdout.write, "last words"), sys.exit(0)), None),
    "thread_and_atexit": (
        lambda: (atexit.register(print, "atexit ran"), threading.Thread(target=_late_thread).start(), sys.exit(0)),
        None,
    ),
}


class _SaysWhenFreed:
    def __del__(self, write: Any = os.write) -> None:  # os.write bound now: the teardown may have cleared os
        write(2, b"torn down\n")


_KEPT: list[_SaysWhenFreed] = []


def kept_till_teardown() -> Any:
    """The default data, with an object that this module keeps and that says so when it is freed: by
    the interpreter's teardown of the modules, which an os._exit skips."""
    _KEPT.append(_SaysWhenFreed())
    return plugins.digits()


def forked() -> bool:
    """Whether this process was forked from tests/starter.py (python's own argv is the starter's)."""
    return any(arg.endswith("starter.py") for arg in sys.orig_argv)


def ending(how: str) -> Any:
    """A data factory (called before ddpjob handles any signal) that ends this process as ``how``
    says (ENDINGS); it says first whether it was forked, on stderr."""
    print(f"ending: {how}", flush=True)
    print(f"forked: {forked()}", file=sys.stderr, flush=True)
    ENDINGS[how][0]()
    time.sleep(5)  # a signal's default action ends it here
    raise AssertionError(f"{how} did not end the process")


def sleeper(pid_file: str, seconds: float = 120.0) -> nn.Module:
    """Writes its pid and whether it was forked, then sleeps."""
    with open(pid_file, "w") as f:
        f.write(f"{os.getpid()} {forked()}")
    time.sleep(seconds)
    return plugins.digits_mlp()


def pipe_holder(pid_file: str) -> nn.Module:
    """Starts a child that keeps stdout and stderr open for 60 s, writes its pid and whether this
    process was forked, then fails at once."""
    import subprocess

    child = subprocess.Popen(["sleep", "60"])
    with open(pid_file, "w") as f:
        f.write(f"{child.pid} {forked()}")
    sys.exit(5)
