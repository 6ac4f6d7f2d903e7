"""The row of test_config.py that needs a real read-only mount (the unit tier starts no process)."""

import pytest

from ddpjob import config
from ddpjob.errors import UsageError


def load(argv):
    parser = config.make_parser("t", "t")
    config.add_config_flags(parser)
    return config.load(parser.parse_args(argv), {})


def test_unwritable_paths_are_refused_even_for_root(tmp_path, monkeypatch):
    """A read-only mount: access(2) says EROFS to root too (a chmod would not stop root)."""
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        monkeypatch.chdir(tmp_path)
        for argv, words in (
            (["--checkpoint-dir", str(ro)], "is not writable"),
            (["--run-dir", str(ro / "new")], "cannot be created"),
            (["--metrics", str(ro / "m.jsonl")], "cannot be created"),
        ):
            with pytest.raises(UsageError, match=words):
                load(argv)
    finally:
        subprocess.run(["umount", str(ro)], check=True)
