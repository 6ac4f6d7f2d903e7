"""Every command that writes a file the user names, walked over every kind of destination.

Invariant: nothing the user had is deleted, moved or overwritten (a plot replaces only an earlier
plot, as its doc says), and a refusal is one line and exit 2 that leaves the tree as it was. The rows
come from the CLI itself: its commands (each one is a writer here or is named as writing no such
file) and convert's --to targets; each is crossed with every destination case below.
"""

import hashlib
import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ddpjob import cli
from ddpjob.checkpoint import catalogue
from ddpjob.tools import ckpt

# Commands that write no file the user names as a destination: train and launch write into their
# --run-dir (test_bad_input covers its paths), the others only read and print.
NO_NAMED_OUTPUT = {"train", "launch", "doctor", "diagnose", "config"}


@dataclass(frozen=True)
class Writer:
    name: str
    argv: Callable[[Path, Path], list[str]]  # (src, dest) -> the command's arguments
    folder: bool  # writes a folder (else one file)
    suffix: str  # of a new destination's name


def convert(to: str, *extra: str) -> Callable[[Path, Path], list[str]]:
    return lambda src, dest: ["ckpt", "convert", str(src), str(dest), "--to", to, *extra]


WRITERS = [Writer(f"convert --to {to}", convert(to), to == "dcp", "" if to == "dcp" else ".out") for to in ckpt.TARGETS]
WRITERS += [
    Writer("convert --to safetensors --max-shard-size", convert("safetensors", "--max-shard-size", "1KB"), True, "")
]
WRITERS += [Writer("plot", lambda src, dest: ["plot", str(src), "--out", str(dest)], False, ".png")]
COMMANDS_WRITING = {"ckpt": "convert", "plot": "plot"}


def source(writer: Writer, tmp: Path) -> Path:
    """What the writer reads: a DCP checkpoint folder (so that a destination can lie inside it), or
    a run's metrics.jsonl."""
    if writer.name == "plot":
        run = tmp / "run"
        run.mkdir()
        rows = [{"event": "train", "step": s, "loss": 1.0 / s, "samples_per_s": 10.0} for s in range(1, 4)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return run / "metrics.jsonl"
    torch.manual_seed(0)
    torch.save({"layer.weight": torch.randn(64, 8), "layer.bias": torch.randn(64)}, tmp / "w.pt")
    ckpt.convert(tmp / "w.pt", tmp / "ckpts" / "step-5", "dcp", "")
    (tmp / "w.pt").unlink()
    return tmp / "ckpts" / "step-5"


def _user_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("the user's own file\n")
    return path


# Each destination case: (src, tmp, suffix) -> the destination, made as the case says.
DESTINATIONS: dict[str, Callable[[Path, Path, str], Path]] = {
    "missing": lambda src, tmp, sfx: tmp / f"new{sfx}",
    "missing parents": lambda src, tmp, sfx: tmp / "a" / "b" / f"new{sfx}",
    "empty folder": lambda src, tmp, sfx: (tmp / "empty").mkdir() or tmp / "empty",
    "non-empty folder": lambda src, tmp, sfx: _user_file(tmp / "full" / "notes.txt").parent,
    "existing file": lambda src, tmp, sfx: _user_file(tmp / f"mine{sfx}"),
    "inside SRC": lambda src, tmp, sfx: src / f"new{sfx}",
    "containing SRC": lambda src, tmp, sfx: src.parent,
    "same as SRC": lambda src, tmp, sfx: src,
    "parent is a file": lambda src, tmp, sfx: _user_file(tmp / "afile") / f"new{sfx}",
    "read-only parent": lambda src, tmp, sfx: _read_only(tmp / "locked") / f"new{sfx}",
    "user's matplotlib PNG": lambda src, tmp, sfx: _user_png(tmp / f"paper_fig{sfx}"),
    "link to a user's file": lambda src, tmp, sfx: _link(tmp / f"link{sfx}", _user_file(tmp / "target.txt")),
    "link to an empty folder": lambda src, tmp, sfx: _link(tmp / "link", (tmp / "empty").mkdir() or tmp / "empty"),
    "dangling link": lambda src, tmp, sfx: _link(tmp / f"link{sfx}", tmp / "nowhere"),
    "FIFO": lambda src, tmp, sfx: _fifo(tmp / f"fifo{sfx}"),
    "manifest path taken": lambda src, tmp, sfx: _user_file(tmp / f"new{sfx}.sum").with_suffix(""),
    "folder named x/..": lambda src, tmp, sfx: (tmp / "holder" / "x").mkdir(parents=True) or tmp / "holder/x/..",
}


def _user_png(path: Path) -> Path:
    """A figure the user saved with matplotlib (its metadata says Matplotlib, as ddpjob's plots did)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 1))
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def _link(path: Path, target: Path) -> Path:
    path.symlink_to(target)
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _read_only(folder: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    folder.mkdir()
    folder.chmod(0o555)
    return folder


def allowed(writer: Writer, case: str) -> bool:
    """Whether the destination may be written: a new path (whose manifest path is new too, for a
    writer of a manifest), or an empty folder for a folder."""
    if case == "manifest path taken":
        return not any(writer.name == f"convert --to {to}" for to in ckpt.WITH_MANIFEST)
    return case in ("missing", "missing parents") or (case == "empty folder" and writer.folder)


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root: a link and its target, a folder (the same one: inode, mode, owner),
    another kind of file, or a file's content digest."""

    def state(p: Path) -> str:
        if p.is_symlink():
            return f"link to {os.readlink(p)}"
        st = p.stat()
        if p.is_dir():
            return f"dir {st.st_ino} {st.st_mode:o} {st.st_uid}:{st.st_gid}"
        return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else f"special {st.st_mode:o}"

    return {str(p.relative_to(root)): state(p) for p in sorted(root.rglob("*"))}


def run_cli(argv: list[str]) -> int:
    """The CLI in this process: a traceback is an exception that fails the test."""
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse
        return int(exc.code or 0)


def test_every_command_is_a_writer_row_or_named_as_writing_no_named_file():
    assert set(cli.COMMANDS) == NO_NAMED_OUTPUT | set(COMMANDS_WRITING)
    assert {w.name.split()[0] for w in WRITERS} == set(COMMANDS_WRITING.values())


@pytest.mark.parametrize("case", list(DESTINATIONS))
@pytest.mark.parametrize("writer", WRITERS, ids=lambda w: w.name)
def test_a_writer_never_destroys_what_the_user_had_and_refuses_in_one_line(tmp_path, capsys, writer, case):
    src = source(writer, tmp_path)
    dest = DESTINATIONS[case](src, tmp_path, writer.suffix)
    before = snapshot(tmp_path)
    capsys.readouterr()
    code = run_cli(writer.argv(src, dest))
    out, err = capsys.readouterr()
    after = snapshot(tmp_path)
    if allowed(writer, case):
        assert code == 0, err
        assert {k: v for k, v in after.items() if k in before} == before  # nothing changed or gone
        assert dest.is_dir() == writer.folder and dest.exists()
    else:
        assert code == 2, (out, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("ddpjob: error: "), err
        assert after == before  # nothing written, moved or removed


def test_plot_replaces_an_earlier_plot_it_wrote(tmp_path, capsys):
    run = source(WRITERS[-1], tmp_path).parent
    assert run_cli(["plot", str(run)]) == 0
    first = (run / "metrics.png").stat().st_mtime_ns
    assert run_cli(["plot", str(run)]) == 0, capsys.readouterr().err
    assert (run / "metrics.png").stat().st_mtime_ns >= first
    assert (run / "metrics.png").read_bytes().startswith(b"\x89PNG")


def test_convert_to_dcp_into_the_current_empty_folder_writes_into_it(tmp_path, monkeypatch, capsys):
    """DEST "." names the folder it resolves to (it has no name of its own to put a temporary next to)."""
    src = source(WRITERS[0], tmp_path)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert run_cli(["ckpt", "convert", str(src), ".", "--to", "dcp"]) == 0, capsys.readouterr().err
    assert catalogue.verify(tmp_path / "here") is None


def test_convert_to_dcp_into_an_empty_mount_point_writes_into_it(tmp_path, capsys):
    """A mount point cannot be renamed or removed: the folder is written into, never swapped out."""
    src = source(WRITERS[0], tmp_path)
    (tmp_path / "disk").mkdir()
    (tmp_path / "mnt").mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", tmp_path / "disk", tmp_path / "mnt"]).returncode:
        pytest.skip("needs root and a bind mount")
    try:
        assert run_cli(["ckpt", "convert", str(src), str(tmp_path / "mnt"), "--to", "dcp"]) == 0, capsys.readouterr()
        assert catalogue.verify(tmp_path / "mnt") is None
        assert sorted(os.listdir(tmp_path / "disk")) == sorted(os.listdir(tmp_path / "mnt"))  # in the mounted folder
    finally:
        subprocess.run(["umount", tmp_path / "mnt"], check=True)
