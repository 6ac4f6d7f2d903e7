"""Optional dependencies: imported where they are used, through ``require``.

A missing (or broken) one is one line naming the extra that installs it, exit code 2, instead of
a ModuleNotFoundError traceback. Every package of an extra in pyproject.toml is listed in EXTRAS
(a test checks it), and no other module imports them directly (a test checks that too).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from ddpjob.errors import UsageError, first_line

EXTRAS = {
    "matplotlib": "tools",
    "safetensors": "tools",
    "tensorboard": "tools",
    "mlflow": "trackers",
    "wandb": "trackers",
    "torchdata": "streams",
}  # package -> extra


def require(module: str, purpose: str, package: str = "") -> ModuleType:
    """Import `module` (of the optional `package`, by default its top-level name) for `purpose`."""
    package = package or module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise _missing(package, purpose, first_line(exc)) from None


def check(package: str, purpose: str) -> None:
    """That `package` is installed, without importing it (a slow import is left to where it is used)."""
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise _missing(package, purpose, f"No module named {package!r}")


def _missing(package: str, purpose: str, reason: str) -> UsageError:
    return UsageError(
        f"{purpose} needs the optional package {package} ({reason}); "
        f"install it with: pip install 'ddpjob[{EXTRAS.get(package, 'tools')}]'"
    )
