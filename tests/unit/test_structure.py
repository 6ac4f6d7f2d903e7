"""The package's layers: which wing may import which, and no import cycles.

Imports are read from the source with ``ast``: module-level ones, those inside functions, and those
under ``if TYPE_CHECKING:`` (an edge that only a type checker follows is still an edge in the design).
Modules are named by their dotted path under ddpjob: ``launch.agent``, ``checkpoint.formats.dcp_folder``.
The rules come from the tree itself: every sub-package is a wing, every module under
``checkpoint/formats/`` a format, and every top-level module but the CLI the core below the wings.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "ddpjob"
LOOP = ("train.loop", "train.setup")  # the training loop and the set-up that builds its Job
ENTRY = {"cli", "__main__"}  # the entry points: they may import any wing

# Edges that break a rule today, each with why; the change that removes one removes its line here
# (test_each_known_exception_is_still_an_import fails otherwise), so this list only shrinks.
KNOWN = {
    ("checkpoint.manager", "train.optim"): "restore checks and loads the optimizer state (optim.check_resume)",
    ("checkpoint.manager", "train.rng"): "restore sets each rank's RNG states",
}


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file, for every module and sub-package (its __init__) under the package."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts:
            found[".".join(parts)] = path
    return found


def imported(tree: ast.AST, this: str, names: set[str], is_package: bool = False) -> set[str]:
    """The ddpjob modules that one module's source imports, wherever the import statement is."""
    found: set[str] = set()

    def add(dotted: str, members: list[str]) -> None:
        for member in members:  # from x import y: y may be a module
            if f"{dotted}.{member}".strip(".") in names:
                found.add(f"{dotted}.{member}".strip("."))
            elif dotted in names:
                found.add(dotted)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "ddpjob":
                    prefixes = [".".join(parts[1:i]) for i in range(len(parts), 1, -1)]
                    found.update(next(([p] for p in prefixes if p in names), []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x / from ..x import y
                package = this.split(".") if is_package else this.split(".")[:-1]
                base = package[: len(package) - node.level + 1]
                dotted = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            elif node.module and node.module.split(".")[0] == "ddpjob":
                dotted = node.module.partition(".")[2]
            else:
                continue
            add(dotted, [alias.name for alias in node.names])
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    found = modules(package)
    names = set(found)
    return {
        name: imported(ast.parse(path.read_text()), name, names, path.name == "__init__.py") - {name}
        for name, path in found.items()
    }


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def rules(package: Path = PACKAGE) -> list[tuple[str, str, str]]:
    """(importer, forbidden, why); a name stands for its module and everything under it."""
    wings = sorted(p.parent.name for p in package.glob("*/__init__.py"))
    core = sorted(p.stem for p in package.glob("*.py") if p.stem not in ENTRY | {"__init__"})
    formats = sorted(
        f"checkpoint.formats.{p.stem}" for p in package.glob("checkpoint/formats/*.py") if p.stem != "__init__"
    )
    return [
        *(
            ("launch", loop, "the node agent starts the loop as torchrun's worker command, never by import")
            for loop in LOOP
        ),
        *(
            ("tools", loop, "operator tools work on a node, a run dir or a checkpoint, never inside a step")
            for loop in LOOP
        ),
        ("checkpoint", "train", "checkpoints serve the loop and never reach back into train/"),
        *((a, b, "a format never imports another format") for a in formats for b in formats if a != b),
        *((f, loop, "a format never imports the loop") for f in formats for loop in LOOP),
        *((c, w, "the core (config, errors, ...) sits below every wing") for c in core for w in wings),
    ]


def violations(graph: dict[str, set[str]], table: list[tuple[str, str, str]], known: dict) -> list[str]:
    return sorted(
        f"{a} imports {b}: {why}"
        for a, imports in graph.items()
        for b in imports
        for importer, forbidden, why in table
        if under(a, importer) and under(b, forbidden) and (a, b) not in known
    )


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


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checker_sees_imports_everywhere_and_finds_cycles(tmp_path):
    pkg = write(
        tmp_path,
        {
            "a.py": "from ddpjob import b\n",
            "b.py": "def f():\n    from ddpjob.w.c import thing\n",
            "w/__init__.py": "",
            "w/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ddpjob.a import X\n",
            "w/d.py": "import ddpjob.a\nimport os\nfrom . import c\n",
            "w/e.py": "from ddpjob.w import c, d\nfrom .. import b\n",
        },
    )
    graph = import_graph(pkg)
    assert graph == {
        "a": {"b"},
        "b": {"w.c"},
        "w": set(),
        "w.c": {"a"},
        "w.d": {"a", "w.c"},
        "w.e": {"w.c", "w.d", "b"},
    }
    assert cycles(graph) == [{"a", "b", "w.c"}]


def test_a_forbidden_import_breaks_its_rule(tmp_path):
    """Each kind of rule, seen red on a small tree with the shape of ddpjob's."""
    tree = {
        "cli.py": "from ddpjob.train import loop\n",
        "config.py": "",
        "train/__init__.py": "",
        "train/loop.py": "from ddpjob.train import setup\n",
        "train/setup.py": "from ddpjob.checkpoint import manager\n",
        "train/optim.py": "",
        "launch/__init__.py": "",
        "launch/agent.py": "from ddpjob.train import optim\n",
        "tools/__init__.py": "",
        "tools/plot.py": "",
        "checkpoint/__init__.py": "",
        "checkpoint/manager.py": "from ddpjob.checkpoint.formats import one\n",
        "checkpoint/formats/__init__.py": "",
        "checkpoint/formats/one.py": "",
        "checkpoint/formats/two.py": "",
    }
    pkg = write(tmp_path, tree)
    assert violations(import_graph(pkg), rules(pkg), {}) == []
    for name, line, rule in [
        ("tools/plot.py", "from ddpjob.train import loop", "tools.plot imports train.loop"),
        ("launch/agent.py", "from ddpjob.train.loop import run", "launch.agent imports train.loop"),
        ("tools/plot.py", "from ddpjob.train.setup import Job", "tools.plot imports train.setup"),
        ("checkpoint/manager.py", "from ddpjob.train import optim", "checkpoint.manager imports train.optim"),
        ("checkpoint/formats/one.py", "from . import two", "checkpoint.formats.one imports checkpoint.formats.two"),
        ("checkpoint/formats/two.py", "import ddpjob.train.loop", "checkpoint.formats.two imports train.loop"),
        ("config.py", "from ddpjob.tools import plot", "config imports tools.plot"),
    ]:
        write(pkg, {name: tree[name] + line + "\n"})
        found = violations(import_graph(pkg), rules(pkg), {})
        assert any(rule in v for v in found), (line, found)
        write(pkg, {name: tree[name]})


def test_every_layer_rule_holds():
    found = violations(import_graph(), rules(), KNOWN)
    assert not found, "\n".join(found)


def test_each_known_exception_is_still_an_import():
    graph = import_graph()
    gone = [edge for edge in KNOWN if edge[1] not in graph.get(edge[0], set())]
    assert not gone, f"no longer imported: remove from KNOWN: {gone}"


def test_doctor_and_launch_share_the_plan_without_importing_each_other():
    graph = import_graph()
    assert "launch.plan" in graph["tools.doctor"] and "launch.plan" in graph["launch.agent"]
    assert "launch.agent" not in graph["tools.doctor"] and not graph["launch.plan"]


def test_no_import_cycle_among_ddpjob_modules():
    found = cycles(import_graph())
    assert not found, f"import cycles: {[' <-> '.join(sorted(c)) for c in found]}"


def test_console_lines_go_through_the_one_logger():
    """ddpjob.log owns the `[ddpjob]` prefix and the level words: no module prints them by hand."""
    package = Path(__file__).resolve().parents[2] / "src" / "ddpjob"
    by_hand = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "log.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "[ddpjob]" in node.value:
                by_hand.append(f"{path.relative_to(package)}:{node.lineno}")
    assert by_hand == [], "use ddpjob.log.info/warning/failure"
