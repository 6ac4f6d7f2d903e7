"""Optional dependencies (pyproject's extras): missing, each is one line naming the extra, exit 2.

Each case runs the real CLI in a child process that cannot import the package: a directory early
on PYTHONPATH holds a stand-in that raises ModuleNotFoundError, as an uninstalled package would."""

import ast
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from ddpjob import checkpoint, optional
from ddpjob.errors import UsageError
from helpers import PY, REPO, clean_env
from plugins.shards import write_shards

SRC = REPO / "src" / "ddpjob"


def without(package: str, tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    hidden = tmp_path / "hidden"
    (hidden / package).mkdir(parents=True)
    (hidden / package / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{package}'\", name={package!r})\n"
    )
    env = clean_env()
    env["PYTHONPATH"] = f"{hidden}:{env['PYTHONPATH']}"
    return subprocess.run(
        [PY, "-m", "ddpjob", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def metrics_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"event": "start", "step": 0}, {"event": "train", "step": 1, "loss": 1.0, "samples_per_s": 9.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run


def weights_file(tmp_path: Path) -> Path:
    path = tmp_path / "w.pt"
    checkpoint.save({"model": {"w": torch.zeros(2)}}, path)
    return path


def stream_job(tmp_path: Path) -> list[str]:
    """Training on the stream plug-in, whose sample files it writes first."""
    write_shards(tmp_path / "shards", [40])
    return ["train", "--data", "tests.plugins.shards:sharded", "--max-steps", "2"]


def safetensors_file(tmp_path: Path) -> Path:
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\0" * 16)  # never read: the import fails first
    return path


CASES = [
    ("matplotlib", lambda t: ["plot", str(metrics_run(t))], "ddpjob plot needs"),
    (
        "safetensors",
        lambda t: ["ckpt", "convert", str(weights_file(t)), "w.safetensors", "--to", "safetensors"],
        "--to",
    ),
    ("safetensors", lambda t: ["ckpt", "inspect", str(safetensors_file(t))], "reading"),
    ("tensorboard", lambda t: ["train", "--tensorboard", "tb", "--epochs", "1"], "--tensorboard tb needs"),
    ("tensorboard", lambda t: ["launch", "--tensorboard", "tb", "--epochs", "1"], "--tensorboard tb needs"),
    ("torchdata", stream_job, "an IterableDataset (--data) needs"),
]


@pytest.mark.parametrize("package, argv, words", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_missing_optional_package_is_one_line_naming_the_extra(tmp_path, package, argv, words):
    proc = without(package, tmp_path, argv(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("ddpjob: error: ") and words in lines[0]
    assert f"optional package {package}" in lines[0] and f"pip install 'ddpjob[{optional.EXTRAS[package]}]'" in lines[0]
    assert not (tmp_path / "w.safetensors").exists() and not (tmp_path / "tb").exists()


def test_require_names_the_package_and_extra(monkeypatch):
    for name in ("safetensors", "safetensors.torch"):  # what a failed import leaves (another test may have imported it)
        monkeypatch.setitem(__import__("sys").modules, name, None)
    with pytest.raises(UsageError, match=r"x needs the optional package safetensors \(.*\); .*ddpjob\[tools\]"):
        optional.require("safetensors.torch", "x")
    assert optional.require("json", "y") is json


@pytest.mark.parametrize("extra", ["tools", "trackers", "streams"])
def test_every_extra_package_is_known_to_require(extra):
    text = (REPO / "pyproject.toml").read_text()
    listed = re.search(rf"^{extra} = \[(.*)\]", text, re.M)
    assert listed, f"pyproject.toml has no {extra} extra"
    packages = set(re.findall(r'"([A-Za-z0-9_.-]+)', listed.group(1)))
    assert packages == {p for p, e in optional.EXTRAS.items() if e == extra}


def test_optional_packages_are_imported_only_through_require():
    direct = []
    for path in SRC.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            direct += [f"{path.name}: {n}" for n in names if n.split(".")[0] in optional.EXTRAS]
            if names and any(n.startswith("torch.utils.tensorboard") for n in names):
                direct.append(f"{path.name}: torch.utils.tensorboard")
    assert not direct, direct
