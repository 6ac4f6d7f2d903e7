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
    handlers = {}
    for sig in sorted(signal.valid_signals()):
        handler = signal.getsignal(sig)
        handlers[str(sig)] = getattr(handler, "__name__", str(handler))
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
        "session": [os.getsid(0) == os.getsid(os.getppid()), os.getpgrp() == os.getpgid(os.getppid())],
        "umask": os.umask(0o22),
        "flags": list(sys.flags),
        "warnoptions": sys.warnoptions,
        "draws": _DRAWS,  # as this module was imported, before ddpjob seeds anything
        "hash": hash("ddpjob"),
        "forked": any(arg.endswith("starter.py") for arg in sys.orig_argv),  # python's own argv: the starter's
    }


def state(out: str) -> nn.Module:
    """Writes this process's state to ``out`` (JSON) and returns the digits model."""
    with open(out, "w") as f:
        json.dump(_state(), f)
    return plugins.digits_mlp()


def _late_thread() -> None:
    time.sleep(0.3)
    print("thread ended", flush=True)


ENDINGS = {  # how -> what the factory does
    "exit 3": lambda: sys.exit(3),
    "os._exit 4": lambda: os._exit(4),
    "SIGTERM": lambda: os.kill(os.getpid(), signal.SIGTERM),
    "SIGKILL": lambda: os.kill(os.getpid(), signal.SIGKILL),
    "abort": os.abort,
    "KeyboardInterrupt": lambda: os.kill(os.getpid(), signal.SIGINT),
    "thread and atexit": lambda: (
        atexit.register(print, "atexit ran"),
        threading.Thread(target=_late_thread).start(),
        sys.exit(0),
    ),
}


def ending(how: str) -> Any:
    """A data factory (called before ddpjob handles any signal) that ends this process as ``how``
    says (ENDINGS)."""
    print(f"ending: {how}", flush=True)
    ENDINGS[how.replace("_", " ")]()
    time.sleep(5)  # a signal's default action ends it here
    raise AssertionError(f"{how} did not end the process")


def sleeper(pid_file: str, seconds: float = 120.0) -> nn.Module:
    """Writes its pid, then sleeps."""
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)
    return plugins.digits_mlp()


def pipe_holder(pid_file: str) -> nn.Module:
    """Starts a child that keeps stdout and stderr open for 60 s, writes its pid, then fails at once."""
    import subprocess

    child = subprocess.Popen(["sleep", "60"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    sys.exit(5)
