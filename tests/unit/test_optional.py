"""Optional dependencies (pyproject's extras): missing, each is one line naming the extra, exit 2.

Each case runs the real CLI in a child process that cannot import the package: a directory early
on PYTHONPATH holds a stand-in that raises ModuleNotFoundError, as an uninstalled package would."""

import ast
import json
import re

import pytest

from ddpjob import optional
from ddpjob.errors import UsageError
from helpers import REPO

SRC = REPO / "src" / "ddpjob"


def test_require_names_the_package_and_extra(monkeypatch):
    for name in ("safetensors", "safetensors.torch"):  # what a failed import leaves (another test may have imported it)
        monkeypatch.setitem(__import__("sys").modules, name, None)
    with pytest.raises(UsageError, match=r"x needs the optional package safetensors \(.*\); .*ddpjob\[tools\]"):
        optional.require("safetensors.torch", "x")
    assert optional.require("json", "y") is json


@pytest.mark.parametrize("extra", ["tools", "trackers", "streams", "s3"])
def test_every_extra_package_is_known_to_require(extra):
    text = (REPO / "pyproject.toml").read_text()
    listed = re.search(rf"^{extra} = \[(.*)\]", text, re.M)
    assert listed, f"pyproject.toml has no {extra} extra"
    packages = set(re.findall(r'"([A-Za-z0-9_.-]+)', listed.group(1)))
    assert packages == {p for p, e in optional.EXTRAS.items() if e == extra}


def test_optional_packages_are_imported_only_through_require():
    direct = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            direct += [f"{path.name}: {n}" for n in names if n.split(".")[0] in optional.EXTRAS]
            if names and any(n.startswith("torch.utils.tensorboard") for n in names):
                direct.append(f"{path.name}: torch.utils.tensorboard")
    assert not direct, direct
