"""The default demo's data in a real install: the wheel ships the digits and their notice, and the
demo trains where scikit-learn and scipy cannot be imported (the runtime no longer has them)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from helpers import PY, REPO, clean_env


def test_the_demo_trains_where_scikit_learn_and_scipy_cannot_be_imported(tmp_path):
    hidden = tmp_path / "hidden"
    for package in ("sklearn", "scipy"):
        (hidden / package).mkdir(parents=True)
        (hidden / package / "__init__.py").write_text(f"raise ModuleNotFoundError('no {package}', name={package!r})\n")
    env = clean_env()
    env["PYTHONPATH"] = f"{hidden}:{env['PYTHONPATH']}"
    cmd = [PY, "-m", "ddpjob", "train", "--device", "cpu", "--max-steps", "2", "--run-dir", "run"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_wheel_ships_the_digits_and_their_notice(tmp_path):
    """Built from a copy of the sources without build leftovers: a stale src/ddpjob.egg-info lists
    the data files itself, and so shipped them even with pyproject's package-data removed."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (source / name).write_bytes((REPO / name).read_bytes())
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    wheel = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    (built,) = Path(tmp_path).glob("ddpjob-*.whl")
    wheel_zip = zipfile.ZipFile(built)
    assert {"ddpjob/data/digits.npz", "ddpjob/data/NOTICE"} <= set(wheel_zip.namelist())
    metadata = wheel_zip.read(next(n for n in wheel_zip.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0 AND CC-BY-4.0" in metadata.splitlines()
