"""The package's structure: no two ddpjob modules import each other, directly or through others.

Imports are read from the source with ``ast``: module-level ones, those inside functions, and those
under ``if TYPE_CHECKING:`` (a cycle that only a type checker follows is still a cycle in the design).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddpjob"


def modules(package: Path = PACKAGE) -> set[str]:
    return {p.stem for p in package.glob("*.py") if p.stem != "__init__"}


def imported(tree: ast.AST, names: set[str]) -> set[str]:
    """The ddpjob modules that one module's source imports, wherever the import statement is."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "ddpjob" and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x / from .x import y
                base = (node.module or "").split(".")[0]
            elif node.module and node.module.split(".")[0] == "ddpjob":
                base = node.module.split(".")[1] if "." in node.module else ""
            else:
                continue
            if base:
                found.add(base)
            else:  # from ddpjob import x: x may be a module
                found.update(alias.name for alias in node.names)
    return found & names


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    names = modules(package)
    return {name: imported(ast.parse((package / f"{name}.py").read_text()), names) - {name} for name in names}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_sees_imports_everywhere_and_finds_cycles(tmp_path):
    (tmp_path / "a.py").write_text("from ddpjob import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from ddpjob.c import thing\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ddpjob.a import X\n")
    (tmp_path / "d.py").write_text("import ddpjob.a\nimport os\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [{"a", "b", "c"}]


def test_doctor_and_launch_share_the_plan_without_importing_each_other():
    graph = import_graph()
    assert "plan" in graph["doctor"] and "plan" in graph["launch"]
    assert "launch" not in graph["doctor"] and not graph["plan"]


def test_no_import_cycle_among_ddpjob_modules():
    found = cycles(import_graph())
    assert not found, f"import cycles: {[' <-> '.join(sorted(c)) for c in found]}"
