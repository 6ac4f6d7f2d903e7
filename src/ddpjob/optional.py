"""Optional dependencies: imported where they are used, through ``require``.

A missing (or broken) one is one line naming the extra that installs it, exit code 2, instead of
a ModuleNotFoundError traceback. Every package of an extra in pyproject.toml is listed in EXTRAS
(a test checks it), and no other module imports them directly (a test checks that too).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ddpjob.errors import UsageError, first_line

EXTRAS = {
    "matplotlib": "tools",
    "safetensors": "tools",
    "tensorboard": "tools",
    "torchdata": "streams",
}  # package -> extra


def require(module: str, purpose: str, package: str = "") -> ModuleType:
    """Import `module` (of the optional `package`, by default its top-level name) for `purpose`."""
    package = package or module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(
            f"{purpose} needs the optional package {package} ({first_line(exc)}); "
            f"install it with: pip install 'ddpjob[{EXTRAS.get(package, 'tools')}]'"
        ) from None
