"""How launch starts its workers: forked from launch on CPU, exec'd (``python -u -m ddpjob train``) where
a worker may use CUDA (``--worker-start auto|fork|exec``).

Why: an exec'd worker imports torch (about 1.5 s of CPU) and, in DDP's constructor, torch._dynamo
(about 1.3 s). A fork of launch, which has both imported, starts with them: on CPU, where workers
share the node's cores, the start of a job costs about half the CPU (bench/worker_start.py).

How: within ``forking``, torch's ``SubprocessHandler._popen`` forks for exactly
``sys.executable -u -m ddpjob train ...`` and returns a ``ForkedWorker``, which the agent uses as the
Popen it would have had (pid, poll, wait, signals; its own session, so the agent's killpg works).
Every stop path of the agent is its own code, unchanged. The child first becomes what an exec'd
``python -u`` would be (``_become_worker``), then runs ``ddpjob train`` as ``__main__`` would
(``_run_as_main``).

Launch runs none of the user's code where it forks (a module's import-time state would be every
worker's): the plug-in imports, the elastic data probe and the preflight run in short-lived forks
(``checked_apart``), whose answer comes back through a pipe.

What a forked worker shares with launch, unlike an exec'd one, is in docs/clusters.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, Protocol, TypeVar

from ddpjob.config import WORKER_STARTS
from ddpjob.errors import UsageError

SETTINGS = WORKER_STARTS  # --worker-start
WORKER_ARGS = ("-u", "-m", "ddpjob", "train")  # what torchrun puts after sys.executable for `-m ddpjob train`
READY_TIMEOUT_S = 60.0  # a child that has not started its session by then is killed, and the start fails
_PR_SET_NAME = 15
T = TypeVar("T")


class Worker(Protocol):
    """What a forked worker runs (cli.ForkedTrain): preload() in launch, before the first fork; run(argv)
    in each worker, as ``python -m ddpjob train ARGV`` would."""

    def preload(self) -> None: ...

    def run(self, argv: Sequence[str]) -> int: ...


def forks(setting: str, device: str, cuda: bool) -> bool:
    """Whether launch forks its workers. ``auto``: where no worker may use CUDA (``--device cpu``, or
    ``auto`` with no visible GPU); ``fork`` where one may is bad input (CUDA does not survive a fork)."""
    may_use_cuda = device == "cuda" or (device == "auto" and cuda)
    if setting == "fork" and may_use_cuda:
        raise UsageError(
            f"--worker-start fork with --device {device}{' and a visible GPU' if cuda else ''}: a CUDA context "
            "does not survive a fork; use --worker-start exec (or auto, which forks only CPU workers)"
        )
    return setting == "fork" or (setting == "auto" and not may_use_cuda)


@contextlib.contextmanager
def forking(worker: Worker) -> Iterator[None]:
    """While torchrun's agent runs in this process, its workers are forks of it (see the module doc)."""
    import torch
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    original = handler.__dict__.get("_popen")
    if not callable(original):
        raise UsageError(
            f"torch {torch.__version__}'s SubprocessHandler has no _popen: launch cannot fork its workers; "
            "pass --worker-start exec"
        )
    worker.preload()
    threads = torch.get_num_threads()
    # GNU OpenMP does not survive a fork of a process that ran a parallel region: launch runs none
    # (one thread), and each worker sets its own count (_become_worker)
    torch.set_num_threads(1)

    def popen(self: Any, args: Sequence[str], env: dict[str, str]) -> Any:
        if tuple(args[: len(WORKER_ARGS) + 1]) != (sys.executable, *WORKER_ARGS):
            return original(self, args, env)
        return start(worker, list(args[len(WORKER_ARGS) + 1 :]), env, self._stdout, self._stderr, threads)

    handler._popen = popen  # type: ignore[method-assign]
    try:
        yield
    finally:
        handler._popen = original  # type: ignore[method-assign]
        torch.set_num_threads(threads)


class ForkedWorker:
    """A forked worker, as torch's agent uses a Popen: pid, returncode, poll, wait, send_signal."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid, self.args = pid, list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                self._reap(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def _reap(self, options: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, options)
        except ChildProcessError:  # reaped elsewhere: its code is lost, and it is not a success
            self.returncode = 255
            return
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(worker: Worker, argv: list[str], env: dict[str, str], stdout: Any, stderr: Any, threads: int) -> ForkedWorker:
    """Fork one worker; return once it leads its own session (torch's agent stops it by killpg)."""
    ready_r, ready_w = os.pipe()
    try:
        pid = _fork(lambda mask: _become_worker(worker, argv, env, stdout, stderr, threads, ready_w, mask))
    finally:
        os.close(ready_w)
    try:
        ready, _, _ = select.select([ready_r], [], [], READY_TIMEOUT_S)
        started = bool(ready) and os.read(ready_r, 1) == b"1"
    finally:
        os.close(ready_r)
    forked = ForkedWorker(pid, [sys.executable, *WORKER_ARGS, *argv])
    if not started:
        forked.kill()
        forked.wait()
        raise RuntimeError(f"a forked worker (pid {pid}) did not start within {READY_TIMEOUT_S:g} s")
    return forked


def _fork(child: Callable[[Any], NoReturn]) -> int:
    """os.fork with every signal blocked across it, so that none runs launch's handlers in the child;
    ``child(mask)`` runs there (it must end the process; mask: the signals blocked before)."""
    _flush_all()  # else the child would write launch's buffered output again
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = os.fork()
        if pid == 0:
            try:
                # What launch loaded (torch, ddpjob's modules) is never the child's garbage: out of
                # the collector's reach, no collection writes to it and copies its pages until
                # training ends (the loop freezes again, and set-up thaws everything at its end)
                gc.freeze()
                child(mask)
            except BaseException:  # its own set-up failed: say why on stderr, not only with a code
                with contextlib.suppress(BaseException):
                    os.write(2, ("launch's fork: " + traceback.format_exc()).encode(errors="replace"))
            finally:
                os._exit(70)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return pid


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _flush_all() -> None:
    """Python's streams, then C's (what C code, oneDNN's verbose mode or a C extension printed)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        _libc().fflush(None)


def _become_worker(
    worker: Worker,
    argv: list[str],
    env: dict[str, str],
    stdout: Any,
    stderr: Any,
    threads: int,
    ready_w: int,
    mask: Any,
) -> NoReturn:
    """In the child, signals blocked: become what an exec'd ``python -u -m ddpjob train ARGV`` would be
    before any of the worker's code, then run it."""
    os.setsid()
    os.write(ready_w, b"1")
    sigint_ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    for sig in signal.valid_signals():  # caught signals go back to their default, as across an exec
        with contextlib.suppress(OSError, ValueError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    old_streams = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    for fd, redirect in ((1, stdout), (2, stderr)):
        if redirect is not None:
            os.dup2(redirect.fileno(), fd)
    _quiet_launchs_descriptors()
    os.environ.clear()
    os.environ.update(env)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.argv = [os.path.join(package, "__main__.py"), WORKER_ARGS[-1], *argv]  # as `python -m ddpjob train` sets it
    sys.path[0] = os.getcwd()
    _unbuffered_streams(old_streams)
    with contextlib.suppress(Exception):  # C's stdout and stderr unbuffered too, as `python -u` makes them
        libc = _libc()
        for stream_name in ("stdout", "stderr"):
            libc.setvbuf(ctypes.c_void_p.in_dll(libc, stream_name), None, 2, 0)  # _IONBF
    _seed_like_a_new_process()
    import torch

    omp = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(omp) if omp.isdigit() and int(omp) > 0 else threads)
    with contextlib.suppress(Exception):
        comm = f"ddpjob-r{env.get('RANK', '?')}".encode()[:15]
        _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(comm), 0, 0, 0)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    _run_as_main(lambda: worker.run(argv), sigint_ignored)


def _quiet_launchs_descriptors() -> None:
    """Every descriptor of launch's but stdin, stdout and stderr becomes /dev/null: the worker holds no
    socket (the rendezvous store's port), pipe or file of launch's. Made /dev/null, not closed, so that
    a number launch's objects still own is never reused by the worker's own files."""
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != null:
            with contextlib.suppress(OSError):
                os.dup2(null, fd, inheritable=False)
    os.close(null)


def _unbuffered_streams(old: tuple[Any, ...]) -> None:
    """sys.stdout and sys.stderr as ``python -u`` makes them; launch's logging handlers on the old ones
    move to the new ones, and its file handlers are dropped (the worker does not write launch's logs)."""
    encoding = getattr(old[0], "encoding", None) or "utf-8"
    errors = getattr(old[0], "errors", None) or "strict"  # surrogateescape in the C locale, as python sets it
    out = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=encoding, errors=errors, write_through=True)
    err = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding=encoding, errors="backslashreplace", write_through=True
    )
    sys.stdout = sys.__stdout__ = out  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = err  # type: ignore[misc]
    loggers = [logging.getLogger(), *logging.root.manager.loggerDict.values()]
    for logger in (lg for lg in loggers if isinstance(lg, logging.Logger)):
        for handler in list(logger.handlers):
            if isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
            elif isinstance(handler, logging.StreamHandler) and handler.stream in old:
                # assigned, not setStream: that flushes the old stream, whose lock a thread of launch's
                # may have held at the fork
                handler.stream = err if handler.stream in (old[1], old[3]) else out


def _seed_like_a_new_process() -> None:
    """numpy's and torch's CPU generators are seeded from the OS in every new process (python's random
    is reseeded after a fork by python itself): a user's code that draws before ddpjob seeds gets other
    numbers on every rank. (A new process's CUDA generators start from a constant: not forked workers'.)"""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()


def _run_as_main(main: Callable[[], int], sigint_ignored: bool) -> NoReturn:
    """Run main as the interpreter runs ``__main__``, and exit as it would: SystemExit's code; an
    uncaught error's traceback and 1; death by SIGINT after a KeyboardInterrupt; non-daemon threads
    joined, then atexit."""
    interrupted = False
    try:
        if not sigint_ignored:  # inside the try: a Ctrl-C from here on ends it as python's would
            signal.signal(signal.SIGINT, signal.default_int_handler)
        code = _exit_code(main())
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 130, True
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        import atexit

        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        _flush_all()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _exit_code(code: object) -> int:
    """What the interpreter exits with for SystemExit(code): None 0, an int, else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# ---- the user's code, run apart from launch -------------------------------------------------------------


def run_here(check: Callable[..., T], *args: Any) -> T:
    """Where launch does not fork its workers, its checks run in launch itself."""
    return check(*args)


def checked_apart(check: Callable[..., T], *args: Any) -> T:
    """``check(*args)`` in a short-lived fork, so that the user's modules it imports, and what they do as
    they load, are not launch's (and so not every forked worker's). Its value or error comes back: a
    ddpjob error, SystemExit or KeyboardInterrupt as itself; any other as one RuntimeError whose note
    holds the check's traceback."""
    read_fd, write_fd = os.pipe()
    try:
        pid = _fork(lambda mask: _answer(check, args, read_fd, write_fd, mask))
    finally:
        os.close(write_fd)
    try:
        data, code = _read_until_exit(read_fd, pid)
    finally:
        os.close(read_fd)
    answer: tuple[str, Any] = ("", None)
    with contextlib.suppress(Exception):  # none (it failed before answering), or cut short (it died as it did)
        answer = _AnswerUnpickler(io.BytesIO(data)).load() if code == 0 else answer
    kind, value = answer
    if kind == "value":
        return value
    if kind == "error" and isinstance(value, BaseException):
        raise value
    raise RuntimeError(f"launch's check {check.__qualname__} ended with exit code {code} and no answer")


def _answer(check: Callable[..., Any], args: tuple[Any, ...], read_fd: int, write_fd: int, mask: Any) -> NoReturn:
    os.close(read_fd)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        answer: tuple[str, Any] = ("value", check(*args))
    except BaseException as exc:
        answer = ("error", _portable(exc))
    try:
        data = pickle.dumps(answer)
    except Exception as exc:
        data = pickle.dumps(("error", _portable(exc)))
    with os.fdopen(write_fd, "wb") as out:
        out.write(data)
    _end_own_children()
    _flush_all()
    os._exit(0)


def _end_own_children() -> None:
    """The multiprocessing children the check started (a data factory's), ended as python's exit ends
    daemonic ones; never launch's, which this fork's multiprocessing state may also list."""
    import multiprocessing

    own = [p for p in multiprocessing.active_children() if getattr(p, "_parent_pid", None) == os.getpid()]
    for process in own:
        process.terminate()
    for process in own:
        process.join(5)


def _portable(exc: BaseException) -> BaseException:
    """A ddpjob error as itself; any other as a RuntimeError naming it, the check's traceback in a note
    (the user's class may not unpickle in launch, which has not imported its module)."""
    if type(exc).__module__.startswith("ddpjob.") or type(exc) in (SystemExit, KeyboardInterrupt):
        return exc
    plain = RuntimeError(f"{type(exc).__qualname__}: {exc}")
    plain.__notes__ = ["in launch's check:\n" + "".join(traceback.format_exception(exc)).rstrip()]
    return plain


def _read_until_exit(fd: int, pid: int) -> tuple[bytes, int]:
    """Everything the check wrote to fd, and its exit code: read until it exits, not until EOF (a
    process it left behind may hold the pipe open)."""
    chunks: list[bytes] = []
    code = None
    while code is None:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if chunk:
                chunks.append(chunk)
                continue
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])  # EOF: it has closed its end
            break
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
    os.set_blocking(fd, False)
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    return b"".join(chunks), code


class _AnswerUnpickler(pickle.Unpickler):
    """Only ddpjob's classes and python's exceptions come back from a check."""

    def find_class(self, module: str, name: str) -> Any:
        import builtins

        if module.startswith("ddpjob.") or (module == "builtins" and isinstance(getattr(builtins, name, None), type)):
            return super().find_class(module, name)  # imported only once allowed
        raise pickle.UnpicklingError(f"{module}.{name} is not an answer launch reads")
