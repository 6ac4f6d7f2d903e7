"""Optional dependencies: imported where they are used, through ``require``.

Also the C++ compiler that torch.compile's CPU code needs (``require_cpu_compiler``).
A missing (or broken) one is one line naming the extra that installs it, exit code 2, instead of
a ModuleNotFoundError traceback. Every package of an extra in pyproject.toml is listed in EXTRAS
(a test checks it), and no other module imports them directly (a test checks that too).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from types import ModuleType

from ddpjob.errors import UsageError, first_line

EXTRAS = {
    "matplotlib": "tools",
    "safetensors": "tools",
    "tensorboard": "tools",
    "mlflow": "trackers",
    "wandb": "trackers",
    "torchdata": "streams",
    "s3fs": "s3",
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


def url_problem(url: str) -> str:
    """ "" when fsspec has a filesystem for the URL's protocol (``s3://``: s3fs) and its library imports;
    else what is wrong and how to fix it, one line, to follow the value it names."""
    protocol = url.split("://", 1)[0].lower()
    try:
        import fsspec  # a dependency of torch

        fsspec.get_filesystem_class(protocol)
    except ValueError:
        return f"has an unknown protocol {protocol!r}: use s3:// (or any fsspec protocol), or a local path"
    except ImportError as exc:
        package = EXTRA_OF_PROTOCOL.get(protocol, "")
        fix = f"pip install 'ddpjob[{EXTRAS[package]}]'" if package else "install the fsspec library for it"
        return f"needs the fsspec library for {protocol}:// ({first_line(exc)[:100]}); install it with: {fix}"
    return ""


EXTRA_OF_PROTOCOL = {"s3": "s3fs", "s3a": "s3fs"}  # protocol -> the package of EXTRAS that serves it


def _missing(package: str, purpose: str, reason: str) -> UsageError:
    return UsageError(
        f"{purpose} needs the optional package {package} ({reason}); "
        f"install it with: pip install 'ddpjob[{EXTRAS.get(package, 'tools')}]'"
    )


def require_cpu_compiler(purpose: str) -> str:
    """The C++ compiler torch inductor builds CPU kernels with: $CXX when set, else the first of
    g++, c++, clang++, cc, clang on PATH; UsageError when there is none."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++", "cc", "clang"]
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise UsageError(
        f"{purpose} on CPU needs a C++ compiler and none of {', '.join(names)} is on PATH; install one "
        "(apt-get install g++), set CXX, or drop --compile"
    )
