"""A test's `python -m ddpjob ARGS` started as a fork of an interpreter that has imported torch already.

Every command would otherwise import torch and torch._dynamo again: about 2 s of CPU each, and the
process tier starts hundreds of them. So each test process keeps one starter per kind (``plain``, and
``launch``, whose torch loaded under launch's ``TORCH_CPP_LOG_LEVEL=ERROR``: cli._launch). A keeper
forked from it per command forks the command and waits for it; the command becomes what ``python -m
ddpjob ARGS`` would be (its stdin, stdout and stderr, cwd, environment, argv, ``sys.path[0]``, newly
seeded generators), runs ddpjob as ``__main__`` and ends as python's exit would, the way a forked
worker ends (worker_fork._run_as_main): SystemExit's code, an error's traceback and 1, non-daemon
threads joined, atexit, buffers flushed; then os._exit, without the teardown of every module (but
for a rank, RANK or SLURM_PROCID set: _become_the_command).

Two ways in: ``run`` (helpers.ddpjob), as ``subprocess.run`` runs a command to its end, and ``Started``
(helpers.spawn), as ``subprocess.Popen`` starts one in the background: its pid is the command's, so
signals reach it, and its exit code comes from the keeper. What stays exec'd: ``fresh=True``; an
environment whose variables read as python or torch start (``STARTUP_VARIABLES``, PYTHONPATH with a
test's sitecustomize among them) differ from the starter's; everything started by ``torchrun``. Limits:
the commands of one test process share python's string-hash seed; a ``Started`` command's parent is
its keeper, which kills it if the test drops the object (or exits) while it runs.

Protocol, over a Unix socket: the request (a length, then pickled argv, cwd and env, with stdin,
stdout and stderr passed as descriptors); the answer, 4 bytes, the command's pid, then once it has
ended 4 more: the exit code as ``Popen.returncode`` gives it. A ``k`` from the test (its timeout)
makes the keeper kill the command first.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import pickle
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, NoReturn

from ddpjob import distenv
from ddpjob.errors import UsageError
from ddpjob.launch import worker_fork

# Variables read as the interpreter, torch or the C libraries start: a command whose value differs from
# the starter's is exec'd, since a fork would run with the starter's.
STARTUP_VARIABLES = (
    "PYTHON",
    "LD_",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH",
    "INDUCTOR",
    "AOT",
    "CXX",
    "TMP",
    "TEMP",
    "TZ",
    "LC_",
    "LANG",
    "GOMP_",
    "MALLOC_",
    "GLIBC_TUNABLES",
    "CUDA_",
)
KINDS = {  # kind -> what the starter sets before it imports torch, and what it imports
    "plain": ({}, ("torch", "torch._dynamo", "ddpjob.cli", "ddpjob.train.loop")),
    "launch": (
        {"TORCH_CPP_LOG_LEVEL": "ERROR"},
        ("torch", "torch._dynamo", "ddpjob.cli", "ddpjob.launch.agent", "ddpjob.train.loop", "torch.distributed.run"),
    ),
}
CODE = struct.Struct("!i")
SIZE = struct.Struct("!I")
READY_S = 120.0  # for the starter to import torch, on a loaded machine
KILLED_S = 30.0  # for the keeper to answer once it has killed the command


def receive(conn: socket.socket, size: int) -> bytes:
    """Exactly size bytes from conn (fewer only if it closed)."""
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def startup_view(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_VARIABLES)}


def kind_of(args: Sequence[str], cwd: Path, env: dict[str, str], starter_env: dict[str, str]) -> str | None:
    """The starter kind a command can be forked from, or None when it must be exec'd. ``starter_env``:
    the environment the starters start from (helpers.clean_env()). A command that reads an env file
    (cwd/.env, --env-file, DDPJOB_ENV_FILE) is exec'd: ddpjob exports its variables before torch loads."""
    if (cwd / ".env").exists() or "DDPJOB_ENV_FILE" in env or any(a.startswith("--env-file") for a in args):
        return None
    kind = "launch" if list(args[:1]) == ["launch"] else "plain"
    set_first = KINDS[kind][0]
    view = {**set_first, **startup_view(env)} if kind == "launch" and "TORCH_CPP_LOG_LEVEL" not in env else env
    return kind if startup_view(view) == startup_view({**starter_env, **set_first}) else None


# ---- the test's side ----

_STARTERS: dict[tuple[int, str, str], tuple[subprocess.Popen[bytes], str]] = {}
_LOCK = threading.Lock()


def starter_key(kind: str, starter_env: dict[str, str]) -> tuple[int, str, str]:
    """This test process's starter of that kind for that environment's start-up variables."""
    return os.getpid(), kind, repr(sorted(startup_view(starter_env).items()))


def _starter(kind: str, starter_env: dict[str, str]) -> str:
    """The socket of this test process's starter of that kind and environment, started on first use
    (a test that changed a start-up variable of its own process gets a starter of its own)."""
    key = starter_key(kind, starter_env)
    with _LOCK:
        found = _STARTERS.get(key)
        if found is not None and found[0].poll() is None:
            return found[1]
        path = os.path.join(tempfile.mkdtemp(prefix="ddpjob-starter-"), "socket")
        proc = subprocess.Popen(
            [sys.executable, __file__, path, kind, str(os.getpid())],
            env={**starter_env, **KINDS[kind][0]},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ)
        ready = selector.select(READY_S) and proc.stdout.read(1) == b"1"
        selector.close()
        if not ready:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the {kind} starter did not start within {READY_S:g} s (exit {proc.poll()})")
        if not _STARTERS:
            atexit.register(_stop_starters, os.getpid())
        _STARTERS[key] = (proc, path)
        return path


def _stop_starters(owner: int) -> None:
    if os.getpid() != owner:  # a fork of the test process exits: the starters are not its own
        return
    for key in list(_STARTERS):
        if key[0] == owner:
            _stop(key)


def _stop(key: tuple[int, str, str]) -> None:
    """Stops the starter of that key, if it is there."""
    with _LOCK:
        found = _STARTERS.pop(key, None)
    if found is not None:
        proc, path = found
        proc.kill()
        proc.wait()
        Path(path).unlink(missing_ok=True)
        Path(path).parent.rmdir()


def _fork(
    args: Sequence[str], cwd: Path, env: dict[str, str], kind: str, starter_env: dict[str, str], fds: list[int]
) -> tuple[socket.socket, int]:
    """Has this test process's starter of ``kind`` fork the command, with ``fds`` as its stdin, stdout
    and stderr: the connection to its keeper, and the command's pid."""
    return _fork_at(_starter(kind, starter_env), kind, args, cwd, env, fds)


def _fork_at(
    path: str, kind: str, args: Sequence[str], cwd: Path, env: dict[str, str], fds: list[int]
) -> tuple[socket.socket, int]:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        request = pickle.dumps((list(args), str(cwd), dict(env)))
        socket.send_fds(conn, [SIZE.pack(len(request)) + request], fds)
        conn.settimeout(READY_S)  # the keeper forks the command at once
        pid = receive(conn, CODE.size)
        conn.settimeout(None)
        if len(pid) != CODE.size:
            raise RuntimeError(f"the {kind} starter's keeper ended without forking the command")
    except BaseException:
        conn.close()
        raise
    return conn, CODE.unpack(pid)[0]


def run(
    args: Sequence[str], cwd: Path, env: dict[str, str], kind: str, starter_env: dict[str, str], timeout: float | None
) -> subprocess.CompletedProcess[str]:
    """As ``subprocess.run([python, -m, ddpjob, *args], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout)``, the command forked from a starter of ``kind``."""
    cmd = [sys.executable, "-m", "ddpjob", *args]
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        conn, _ = _fork(args, cwd, env, kind, starter_env, [0, out_w, err_w])
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    deadline = time.monotonic() + (timeout if timeout is not None else 10**9)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    selector = selectors.DefaultSelector()
    for fd in chunks:
        selector.register(fd, selectors.EVENT_READ)
    try:
        while selector.get_map():  # both pipes to their end, as communicate() reads them
            left = deadline - time.monotonic()
            events = selector.select(max(left, 0)) if left > 0 else []
            if not events:
                _kill(conn)
                raise subprocess.TimeoutExpired(cmd, timeout, *_output(chunks[out_r], chunks[err_r]))
            for key, _ in events:
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.fd].append(data)
                else:
                    selector.unregister(key.fd)
        conn.settimeout(max(deadline - time.monotonic(), 0.001))  # the command's end, as wait(timeout) waits
        try:
            code = _exit_code(conn, kind)
        except TimeoutError:
            _kill(conn)
            raise subprocess.TimeoutExpired(cmd, timeout) from None  # as wait() raises it: no output
    finally:
        selector.close()
        conn.close()
        os.close(out_r)
        os.close(err_r)
    out, err = (_text(b"".join(chunks[fd])) for fd in (out_r, err_r))
    return subprocess.CompletedProcess(cmd, code, out, err)


def _exit_code(conn: socket.socket, kind: str) -> int:
    """The command's exit code, as its keeper answers it once the command has ended (sent whole)."""
    answer = receive(conn, CODE.size)
    if len(answer) != CODE.size:
        raise RuntimeError(f"the {kind} starter's keeper ended without the command's exit code")
    return CODE.unpack(answer)[0]


class Started:
    """As ``subprocess.Popen([python, -m, ddpjob, *args], cwd=cwd, env=env, stdout=PIPE, stderr=STDOUT,
    text=True)``, the command forked from a starter of ``kind``: ``pid`` is the command's, signals sent
    to it reach the command, ``stdout`` reads its output, ``communicate``, ``wait`` and ``poll`` as
    Popen's. Its exit code comes from its keeper, which kills it if this object is dropped while it runs."""

    def __init__(
        self,
        args: Sequence[str],
        cwd: Path,
        env: dict[str, str],
        kind: str,
        starter_env: dict[str, str],
        stdout: IO[str] | None = None,
    ) -> None:
        self.args = [sys.executable, "-m", "ddpjob", *args]
        self.returncode: int | None = None
        self._kind = kind
        self.stdout: IO[str] | None = None
        if stdout is not None:  # Popen's stdout=FILE, stderr=STDOUT
            self._conn, self.pid = _fork(args, cwd, env, kind, starter_env, [0, stdout.fileno(), stdout.fileno()])
            return
        out_r, out_w = os.pipe()
        try:
            self._conn, self.pid = _fork(args, cwd, env, kind, starter_env, [0, out_w, out_w])
        except BaseException:
            os.close(out_r)
            raise
        finally:
            os.close(out_w)
        # text, universal newlines: Popen's text=True; closed by communicate(), as Popen's
        self.stdout = open(out_r, encoding=_encoding())  # noqa: SIM115
        self._output: list[str] = []
        self._failed: Exception | None = None
        self._reader: threading.Thread | None = None

    def _read(self, stdout: IO[str]) -> None:
        try:
            self._output.append(stdout.read())
        except Exception as error:  # raised again in the test's thread by communicate()
            self._failed = error

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self.wait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if timeout is not None and timeout <= 0 and not select.select([self._conn], [], [], 0)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)  # settimeout(0) would not block at all
            self._conn.settimeout(timeout if timeout is None or timeout > 0 else None)
            try:
                self.returncode = _exit_code(self._conn, self._kind)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, None]:
        """The output to its end (also what a line-by-line read left), then the exit code."""
        deadline = time.monotonic() + timeout if timeout is not None else None
        stdout = self.stdout
        if stdout is None:  # written to a file: only the end to wait for
            self.wait(timeout)
            return None, None
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, args=(stdout,), daemon=True)
            self._reader.start()
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        if self._failed is not None:  # as Popen's communicate raises it (a byte the encoding cannot read)
            raise self._failed
        stdout.close()
        self.wait(max(deadline - time.monotonic(), 0) if deadline is not None else None)
        return "".join(self._output), None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: until its code is read, the pid is the command's (a zombie)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _kill(conn: socket.socket) -> None:
    """The keeper kills the command, as run() does on a timeout, and answers once it is gone (an
    OSError: the command had ended, and its keeper with it)."""
    with contextlib.suppress(OSError):
        conn.settimeout(KILLED_S)
        conn.sendall(b"k")
        receive(conn, CODE.size)


def _output(*streams: list[bytes]) -> list[bytes | None]:
    """What TimeoutExpired holds of each stream, as communicate() leaves it: bytes, or None if nothing came."""
    return [b"".join(chunks) if chunks else None for chunks in streams]


def _encoding() -> str:
    import locale

    return locale.getpreferredencoding(False)


def _text(data: bytes) -> str:
    """As subprocess.run's text=True decodes: the locale's encoding, strict, universal newlines."""
    return data.decode(_encoding()).replace("\r\n", "\n").replace("\r", "\n")


# ---- a `ddpjob` on PATH that forks from the test's starters (tests/process/test_docs.py) ----

SHIM_VARIABLE = "TEST_DDPJOB_STARTERS"  # the starters' sockets and start-up view, for the shim only
SHIM = """#!{python}
import sys
sys.path.insert(0, {tests!r})
import starter
starter.shim_main()
"""


@contextlib.contextmanager
def shim(folder: Path, starter_env: dict[str, str], kinds: Sequence[str]) -> Iterator[dict[str, str]]:
    """A ``ddpjob`` in ``folder`` that runs ``ddpjob train`` and ``ddpjob launch`` as ``python -m ddpjob
    ARGS`` forked from this test process's starters of ``kinds`` for ``starter_env`` (started here, and
    stopped when the block ends); where run() would exec them, no starter of their kind was asked for,
    or for any other command (the tools), it execs the venv's ``ddpjob`` console script. Yields the
    variables that put it first on PATH and tell it where the starters listen."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "ddpjob"
    script.write_text(SHIM.format(python=sys.executable, tests=str(Path(__file__).parent)))
    script.chmod(0o755)
    try:
        sockets = {kind: _starter(kind, starter_env) for kind in kinds}
        info = json.dumps({"sockets": sockets, "view": startup_view(starter_env)})
        yield {"PATH": f"{folder}:{starter_env['PATH']}", SHIM_VARIABLE: info}
    finally:
        for kind in kinds:
            _stop(starter_key(kind, starter_env))


def shim_main() -> NoReturn:
    """The shim's command: forked from the starter of its kind, or exec'd where it must be; signals
    sent to the shim are passed on, and it ends as the command did (its exit code, or the signal that
    ended it)."""
    info = json.loads(os.environ.pop(SHIM_VARIABLE, "null")) or {"sockets": {}, "view": {}}
    args, cwd, env = sys.argv[1:], Path.cwd(), dict(os.environ)
    kind = kind_of(args, cwd, env, info["view"]) if args[:1] in (["train"], ["launch"]) else None
    if kind not in info["sockets"]:  # the console script the shim stands in front of
        os.execv(Path(sys.executable).with_name("ddpjob"), ["ddpjob", *args])
    conn, pid = _fork_at(info["sockets"][kind], kind, args, cwd, env, [0, 1, 2])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda number, _: os.kill(pid, number))
    code = _exit_code(conn, kind)
    if code < 0:  # ended by a signal: so is the shim, as the shell reads it (128 + N)
        with contextlib.suppress(OSError, ValueError):  # KILL and STOP keep their default action anyway
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# ---- the starter's side ----


def _serve(path: str, parent: int) -> tuple[list[str], str, dict[str, str], list[int]]:
    """Accept requests, a keeper forked for each, until the test process is gone. Returns only in a
    command's process: its request and descriptors."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    worker_fork._flush_all()  # nothing buffered for every keeper to write again
    os.write(1, b"1")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # the test reads only the "1": nothing may fill that pipe later
    os.close(null)
    while True:
        events, _, _ = select.select([listener], [], [], 1.0)
        if os.getppid() != parent:
            os._exit(0)
        while True:  # the keepers that ended
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if not events:
            continue
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            return _keep(conn)
        conn.close()


def _keep(conn: socket.socket) -> tuple[list[str], str, dict[str, str], list[int]]:
    """The keeper: fork the command, kill it if the test asks, answer its exit code, then exit.
    Returns only in the command's process."""
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the command's: it shares the test's group
    message, fds, _, _ = socket.recv_fds(conn, SIZE.size + (1 << 20), 3)
    if len(message) < SIZE.size:
        message += receive(conn, SIZE.size - len(message))
    size = SIZE.unpack(message[: SIZE.size])[0]
    body = message[SIZE.size :]
    if len(body) < size:
        body += receive(conn, size - len(body))
    args, cwd, env = pickle.loads(body)
    worker_fork._flush_all()  # python's and C's buffers: else every command would write them again
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGINT, interrupt)
        conn.detach()  # its descriptor becomes /dev/null with the rest (_become_the_command)
        return args, cwd, env, fds
    for fd in fds:
        os.close(fd)
    try:
        with contextlib.suppress(OSError):  # the test gone: the loop below kills the command
            conn.sendall(CODE.pack(pid))
        pidfd = os.pidfd_open(pid)
        selector = selectors.DefaultSelector()
        selector.register(pidfd, selectors.EVENT_READ)
        selector.register(conn, selectors.EVENT_READ)
        ended = False
        while not ended:
            for key, _ in selector.select():
                if key.fd == pidfd:
                    ended = True
                elif conn.recv(1) in (b"k", b""):  # the test's timeout, or the test gone
                    os.kill(pid, signal.SIGKILL)
                    selector.unregister(conn)
        # left a zombie until the test has its code and hangs up, so that its pid stays the command's
        # while the test may still signal it, as a Popen's child does until it is waited for
        info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOWAIT)
        with contextlib.suppress(OSError):
            conn.sendall(CODE.pack(info.si_status if info.si_code == os.CLD_EXITED else -info.si_status))
            while conn.recv(1):
                pass
    except BaseException:  # the test gone mid-answer (a reset), or anything else: never an orphan
        os.kill(pid, signal.SIGKILL)
    finally:
        os.waitpid(pid, 0)
        os._exit(0)


def _a_rank(env: dict[str, str]) -> bool:
    """Whether ddpjob reads ENV as one rank of a job (RANK, or SLURM_PROCID as srun sets it)."""
    try:
        return distenv.resolve(env).source != "single"
    except UsageError:  # it exits 2 at once
        return False


def _become_the_command(args: list[str], cwd: str, env: dict[str, str], fds: list[int]) -> None:
    """In the command's process: what ``python -m ddpjob ARGS`` would be, then ddpjob run as __main__,
    ended as a forked worker ends (worker_fork._run_as_main: python's exit code, traceback, threads
    joined and atexit, then os._exit). Not the interpreter's own finalization: tearing down every
    module of the fork writes to the starter's objects and copies their pages, about 0.9 s of CPU
    per command on a 2-core machine. Except a rank (RANK set by hand, or SLURM_PROCID: _a_rank), as
    torchrun or srun start ranks: its interpreter tears down as theirs does (an object freed late would
    abort there)."""
    import runpy

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    worker_fork._quiet_launchs_descriptors()  # the starter's socket and pipes: /dev/null, numbers kept
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["-m", *args]  # runpy puts the module's file first, as -m does
    sys.path[0] = os.getcwd()  # as -m sets it (this file's folder, as a script, until now)
    worker_fork._seed_like_a_new_process()

    def main() -> int:
        runpy.run_module("ddpjob", run_name="__main__", alter_sys=True)
        return 0

    if _a_rank(env):
        main()  # returns only if ddpjob does: then the interpreter exits as python -m's would
        return
    worker_fork._run_as_main(main, sigint_ignored=signal.getsignal(signal.SIGINT) == signal.SIG_IGN)


if __name__ == "__main__":
    _path, _kind, _parent = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import importlib

    for _name in KINDS[_kind][1]:
        importlib.import_module(_name)

    assert os.listdir("/proc/self/task") == [str(os.getpid())]  # a fork keeps no other thread
    gc.collect()  # then what the starter imported is out of every command's collections: none of them
    gc.freeze()  # writes to it and copies its pages (forked workers do the same, worker_fork._fork)
    _become_the_command(*_serve(_path, _parent))
