"""Exit codes, the error types, and how an error becomes one line and its exit code (run_guarded).

Under torchrun the line also goes to the worker's ``TORCHELASTIC_ERROR_FILE``, where the agent
(``ddpjob launch``) reads it to name the worker's error in its own last line.
"""

import contextlib
import errno
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence

from ddpjob.redact import redact

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_STORAGE = 3
EXIT_NO_RENDEZVOUS = 69  # EX_UNAVAILABLE: the nodes never all came (half-scheduled); nothing trained
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on a signal, checkpoint saved, requeue me


class UsageError(Exception):
    """Bad input (env var, config key, flag, path or checkpoint file).

    The message is one line that names the problem and the fix (several lines only when it
    lists several problems, one per line). The CLI prints it and exits with EXIT_BAD_INPUT.
    """


class StorageError(Exception):
    """A checkpoint could not be written (permissions, disk full). Exit code EXIT_STORAGE."""


class Retriable(Exception):
    """A condition that may clear by itself: a file rank 0 wrote not yet visible on a node's view of
    shared storage, a peer lost. One line; exit code EXIT_FAILED, so a restart or requeue retries."""


class PeerLost(Retriable):
    """A collective failed: a peer died, hung past the collective timeout, or lost its network.

    One line instead of the backend's traceback; exit code EXIT_FAILED, so torchrun may restart.
    """


TRANSIENT_STATUS = (408, 425, 429)  # and every 5xx: a server's "not now"
# Network errors of libraries ddpjob does not import (requests, urllib3, httpx, huggingface_hub, aiohttp, botocore),
# known by their class names; requests' ones are also OSErrors.
TRANSIENT_NAMES = frozenset(
    {
        "ConnectionError",
        "ConnectTimeout",
        "ConnectTimeoutError",
        "ReadTimeout",
        "ReadTimeoutError",
        "Timeout",
        "TimeoutException",
        "ConnectError",
        "ReadError",
        "WriteError",
        "PoolTimeout",
        "NetworkError",
        "RemoteProtocolError",
        "ProtocolError",
        "ProxyError",
        "ChunkedEncodingError",
        "NewConnectionError",
        "MaxRetryError",
        "IncompleteRead",
        "RemoteDisconnected",
        "ClientConnectionError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        # botocore's (an object store through s3fs): a connection closed mid-request or mid-body
        "ConnectionClosedError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "HTTPClientError",
        "ResponseParserError",
    }
)


def _status(exc: BaseException) -> int | None:
    """The HTTP status an error carries: urllib's HTTPError.code, or requests'/httpx's response's."""
    for value in (getattr(exc, "code", None), getattr(getattr(exc, "response", None), "status_code", None)):
        if isinstance(value, int) and 100 <= value < 600:
            return value
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether an error, or one in its ``__cause__``/``__context__`` chain, is a condition a retry may
    clear: a network error (refused, reset, timed out, a name server's EAI_AGAIN), an HTTP 5xx or 429,
    a transient storage errno (EIO, ESTALE, ...)."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        err = todo.pop()
        if not isinstance(err, BaseException) or id(err) in seen:
            continue
        seen.add(id(err))
        status = _status(err)
        if status is not None:
            if status >= 500 or status in TRANSIENT_STATUS:
                return True
        elif (
            isinstance(err, ConnectionError | TimeoutError)
            or (isinstance(err, socket.gaierror) and err.errno in (socket.EAI_AGAIN,))
            or (isinstance(err, OSError) and err.errno in TRANSIENT_ERRNOS)
            or any(cls.__name__ in TRANSIENT_NAMES for cls in type(err).__mro__)
        ):
            return True
        todo += [err.__cause__, err.__context__, getattr(err, "reason", None)]  # URLError keeps it in .reason
    return False


# Storage errors that may clear by themselves (a flaky or failing-over NFS server or object store, a
# lost connection): reading a checkpoint that fails with one of them is retried, never bad input.
# A full disk (ENOSPC) is not among them: it stops saves (StorageError), not reads.
TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ENOLCK}
    | {errno.ECONNRESET, errno.ECONNABORTED, errno.ENOTCONN, errno.ENETDOWN, errno.ENETUNREACH}
    | {errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.EREMOTEIO}
)


def transient(exc: BaseException, what: str) -> Retriable | None:
    """A Retriable for a storage error that may clear while reading ``what``; None for any other error."""
    if is_transient(exc):
        return Retriable(f"cannot read {what}: {first_line(exc)}; a storage error that may clear: a restart retries")
    return None


def denied(exc: BaseException, what: str) -> UsageError | None:
    """A UsageError for permission denied (EACCES, EPERM) reading ``what``, which no retry clears;
    None for any other error."""
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM):
        return UsageError(
            f"cannot read {exc.filename or what}: {exc.strerror or 'permission denied'}; give the job's user read "
            "access to it (chmod/chown), or move it out of the checkpoint dir"
        )
    return None


def first_line(exc: BaseException) -> str:
    """An exception's first message line, or its type name when it has no message."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def exit_code_for(exc: BaseException) -> int:
    if isinstance(exc, UsageError):
        return EXIT_BAD_INPUT
    if isinstance(exc, StorageError):
        return EXIT_STORAGE
    return EXIT_FAILED


def run_guarded(command: Callable[[Sequence[str]], int], argv: Sequence[str]) -> int:
    """Run a command; our errors become one line on stderr and their exit code."""
    try:
        return command(argv)
    except (UsageError, StorageError, Retriable) as exc:
        print(f"ddpjob: error: {redact(str(exc))}", file=sys.stderr, flush=True)
        tell_agent(redact(str(exc)))
        return exit_code_for(exc)
    except KeyboardInterrupt:
        return 130


def tell_agent(message: str) -> None:
    """Leave the error line where torchrun's agent looks for a worker's failure (best effort)."""
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
