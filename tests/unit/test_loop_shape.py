"""The loop's shape: ``train`` reads in a minute, and every exit checkpoints and closes in one place.

Read from the source with ``ast``, nothing runs. The rows come from the code of ``src/ddpjob/train``:
every call of the checkpointer's closing methods wherever it is, every ``return`` of the loop, every
assignment of its exit code. (What each exit does is proven by the process tier: test_stop_paths,
test_resume_rules, test_faults.)
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

from ddpjob.train import loop

TRAIN = Path(__file__).resolve().parents[2] / "src" / "ddpjob" / "train"
ONE_WAY_OUT = "checkpoint_and_close"
ENDING = {"close", "drain"}  # the checkpointer's calls that end its work: only the way out makes them
LOOP_LINES = 70  # "about 60": a loop that reads top to bottom in a minute


def calls_by_function(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    """(innermost enclosing function, call) for every call in the tree."""
    found: list[tuple[str, ast.Call]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name)
            else:
                if isinstance(child, ast.Call):
                    found.append((function, child))
                visit(child, function)

    visit(tree, "<module>")
    return found


def checkpointer_calls(tree: ast.AST, methods: set[str]) -> list[tuple[str, str]]:
    """(function, method) for each call of ``<...>checkpointer.<method>(...)``."""
    return [
        (function, call.func.attr)
        for function, call in calls_by_function(tree)
        if isinstance(call.func, ast.Attribute)
        and call.func.attr in methods
        and ast.unparse(call.func.value).endswith("checkpointer")
    ]


def ways_out(tree: ast.AST) -> list[str]:
    """What breaks the rule in a tree: a checkpointer closed outside the one way out, or more than once."""
    calls = checkpointer_calls(tree, ENDING)
    wrong = [f"{function} calls checkpointer.{method}" for function, method in calls if function != ONE_WAY_OUT]
    closes = [c for c in calls if c[1] == "close"]
    return wrong + ([f"checkpointer.close is called {len(closes)} times"] if len(closes) > 1 else [])


def exits_without_the_way_out(function: ast.FunctionDef) -> list[str]:
    """Each ``return`` of the loop with no ``exit_code = checkpoint_and_close(...)`` before it in its
    block, and each exit code set from anything else once the loop runs (inside its ``try``)."""
    found = []
    for node in ast.walk(function):
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, stmt in enumerate(block):
                if isinstance(stmt, ast.Return) and not any(_sets_exit_code_on_the_way_out(s) for s in block[:i]):
                    found.append(f"line {stmt.lineno}: return {ast.unparse(stmt.value) if stmt.value else ''}")
    for node in ast.walk(function):  # a failure too: each handler takes the way out before it re-raises
        for handler in node.handlers if isinstance(node, ast.Try) else []:
            if not any(_sets_exit_code_on_the_way_out(s) for s in handler.body):
                found.append(f"line {handler.lineno}: except {ast.unparse(handler.type) if handler.type else ''}")
    tried = [node for block in ast.walk(function) if isinstance(block, ast.Try) for node in ast.walk(block)]
    for node in tried:  # once the loop runs, its exit code comes from the way out
        sets = isinstance(node, ast.Assign) and any(ast.unparse(t) == "exit_code" for t in node.targets)
        if sets and not _sets_exit_code_on_the_way_out(node):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def kinds_not_taken(function: ast.FunctionDef, way_out: ast.FunctionDef) -> list[str]:
    """The exits the way out tells apart (its keyword parameters: ``stopped``, ``failure``; none of
    them: the last step) that the loop never takes: a stop or a failure that leaves some other way."""
    kinds = {arg.arg for arg in way_out.args.args[len(way_out.args.args) - len(way_out.args.defaults) :]}
    calls = [call for _, call in calls_by_function(function) if ast.unparse(call.func) == ONE_WAY_OUT]
    taken = {kw.arg or "" for call in calls for kw in call.keywords} | {"" for call in calls if not call.keywords}
    return sorted(f"{ONE_WAY_OUT}({kind or 'job'})" for kind in ({"", *kinds} - taken))


def _sets_exit_code_on_the_way_out(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Assign)
        and [ast.unparse(t) for t in stmt.targets] == ["exit_code"]
        and isinstance(stmt.value, ast.Call)
        and ast.unparse(stmt.value.func) == ONE_WAY_OUT
    )


def train_function() -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(loop.train))).body[0]  # type: ignore[return-value]


def test_the_checkpointer_is_closed_in_one_place_only():
    found = [f"{path.name}: {v}" for path in sorted(TRAIN.rglob("*.py")) for v in ways_out(ast.parse(path.read_text()))]
    assert not found, f"every exit closes the checkpointer through loop.{ONE_WAY_OUT}: {found}"
    assert checkpointer_calls(ast.parse(inspect.getsource(loop)), ENDING), "the way out no longer closes anything"


def test_every_exit_of_the_loop_goes_through_the_way_out():
    function = train_function()
    assert not exits_without_the_way_out(function)
    handlers = [h for node in ast.walk(function) if isinstance(node, ast.Try) for h in node.handlers]
    assert [ast.unparse(h.type) for h in handlers if h.type] == ["BaseException"]  # a failure too


def test_the_loop_takes_every_exit_the_way_out_knows():
    way_out = ast.parse(textwrap.dedent(inspect.getsource(loop.checkpoint_and_close))).body[0]
    assert not kinds_not_taken(train_function(), way_out)  # type: ignore[arg-type]


def test_the_loop_reads_in_a_minute():
    function = train_function()
    lines = function.end_lineno - function.lineno + 1  # type: ignore[operator]
    assert lines <= LOOP_LINES, f"loop.train is {lines} lines: move a part of it into a helper or into setup.py"


def test_the_checks_see_a_second_way_out():
    """Each rule, seen red on a small loop with the shape of ddpjob's."""
    good = """
def train(job):
    exit_code = 0
    try:
        if job.stop:
            exit_code = checkpoint_and_close(job, stopped=True)
            return exit_code
        exit_code = checkpoint_and_close(job)
        return exit_code
    except BaseException as exc:
        exit_code = checkpoint_and_close(job, failure=exc)
        raise

def checkpoint_and_close(job, stopped=False, failure=None):
    job.checkpointer.drain()
    job.checkpointer.close()
"""
    function, way_out = ast.parse(good).body
    assert not ways_out(ast.parse(good)) and not exits_without_the_way_out(function)  # type: ignore[arg-type]
    assert not kinds_not_taken(function, way_out)  # type: ignore[arg-type]
    for before, after, broken in [
        ("            return exit_code", "            job.checkpointer.close()\n            return 75", "train calls"),
        ("    job.checkpointer.close()", "    job.checkpointer.close()\n    job.checkpointer.close()", "2 times"),
        ("        exit_code = checkpoint_and_close(job, failure=exc)", "        exit_code = 1", "exit_code = 1"),
        ("        exit_code = checkpoint_and_close(job)\n", "", "line 8: return exit_code"),
        ("        exit_code = checkpoint_and_close(job, failure=exc)\n", "", "line 10: except BaseException"),
        (
            "            exit_code = checkpoint_and_close(job, stopped=True)\n            return exit_code",
            "            pass",
            "(stopped)",
        ),
    ]:
        source = good.replace(before, after, 1)
        assert source != good, before
        tree = ast.parse(source)
        found = ways_out(tree) + exits_without_the_way_out(tree.body[0])  # type: ignore[arg-type]
        found += kinds_not_taken(*tree.body)  # type: ignore[arg-type]
        assert any(broken in f for f in found), (after, found)
