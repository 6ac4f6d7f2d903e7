"""Exit codes, the error types, and how an error becomes one line and its exit code (run_guarded)."""

import sys
from collections.abc import Callable, Sequence

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_STORAGE = 3
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
        print(f"ddpjob: error: {exc}", file=sys.stderr, flush=True)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        return 130
