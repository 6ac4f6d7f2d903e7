"""Runtime dependencies: every package that ``pip install ddpjob`` pulls into a job's image has a
reason, written here, and is imported by the package; and every third-party package that a module
of src/ddpjob imports when it is imported is one of them. A new one fails until it is argued for,
or moved to an extra (pyproject's [project.optional-dependencies]) and imported where it is used,
through ddpjob.optional.require.

The rule comes from the code: the import statements of every module, found with ast, mapped to the
distributions that install them (importlib.metadata), against pyproject.toml parsed as TOML."""

import ast
import functools
import importlib.metadata
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from helpers import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # a dev dependency on 3.10 (pyproject's dev extra)
    import tomli as tomllib

PACKAGE = REPO / "src" / "ddpjob"

# distribution -> why every job needs it
RUNTIME = {
    "torch": "the model, the training loop, torchrun and the checkpoints",
    "numpy": "the checkpointed RNG state that a bitwise resume restores (train/rng.py); the bundled digits",
    "python-dotenv": "the .env file layer of the one config source (config.py)",
    "xxhash": "the checksum that every checkpoint load verifies (checkpoint/checksum.py)",
}


def runtime_dependencies() -> set[str]:
    """The distributions in pyproject.toml's [project].dependencies, by their canonical names."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {canonicalize_name(Requirement(spec).name) for spec in project["dependencies"]}


def _runs_at_import(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a module body that run when it is imported: into if/try/with and class
    bodies, not into functions (a lazy import) nor ``if TYPE_CHECKING:`` blocks."""
    found: list[ast.stmt] = []
    for node in body:
        found.append(node)
        if isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name | ast.Attribute) and "TYPE_CHECKING" in ast.unparse(node.test)):
                found += _runs_at_import(node.body)
            found += _runs_at_import(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                found += _runs_at_import(block)
        elif isinstance(node, ast.With | ast.ClassDef):
            found += _runs_at_import(node.body)
    return found


def imports(path: Path, at_import_only: bool) -> set[str]:
    """The top-level names of the absolute imports of one module (those run when it is imported, or all)."""
    tree = ast.parse(path.read_text())
    nodes = _runs_at_import(tree.body) if at_import_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def third_party(names: set[str]) -> set[str]:
    return {name for name in names if name not in sys.stdlib_module_names and name not in ("ddpjob", "__future__")}


@functools.cache
def _providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions(module: str) -> set[str]:
    """The installed distributions that provide a top-level module (none: not installed)."""
    return {canonicalize_name(d) for d in _providers().get(module, [])}


def test_every_runtime_dependency_has_a_reason():
    unexplained = runtime_dependencies() - RUNTIME.keys()
    assert not unexplained, (
        f"runtime dependencies without a reason: {sorted(unexplained)}; a job's image carries each one: "
        "add it to RUNTIME here with why every job needs it, or make it an extra"
    )
    assert RUNTIME.keys() <= runtime_dependencies(), "RUNTIME lists a package pyproject.toml no longer needs"


def test_every_third_party_import_that_runs_at_import_is_a_runtime_dependency():
    declared = runtime_dependencies()
    undeclared = [
        f"{path.relative_to(PACKAGE)}: import {name} ({', '.join(sorted(distributions(name))) or 'not installed'})"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name in sorted(third_party(imports(path, at_import_only=True)))
        if not distributions(name) & declared
    ]
    assert not undeclared, (
        f"modules of ddpjob import packages that are not runtime dependencies: {undeclared}; a job's image "
        "lacks them: import it where it is used through ddpjob.optional.require (an extra), or declare it"
    )


def test_every_runtime_dependency_is_imported_by_the_package():
    imported = set().union(*(imports(path, at_import_only=False) for path in PACKAGE.rglob("*.py")))
    provided = set().union(*(distributions(name) for name in third_party(imported)))
    unused = runtime_dependencies() - provided
    assert not unused, f"no module of src/ddpjob imports {sorted(unused)}: drop it from [project].dependencies"
