"""Every shell command in README.md and docs/ runs as written, or says why it cannot run on a CPU machine.

Commands are the lines of ```sh blocks and the `$ ` lines of any block (of a ```sh block too, when it
shows a transcript). Each page's commands run in
order in one scratch directory (so `ddpjob plot runs/x` sees the run a line above made), with the
repository importable and `ddpjob` on PATH (`python -m ddpjob` forked from a starter: tests/starter.py's
shim); a command that names neither `--epochs` nor `--max-steps`
gets `DDPJOB_MAX_STEPS=4`, so that the demo's default 10 epochs stay short. A `$ `
line followed by `ddpjob: error:` must exit 2; every other command must exit 0. A command that
cannot run here matches one row of SKIPPED, with its reason; any other command runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

import starter
from helpers import REPO

pytestmark = pytest.mark.slow

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# first words of a command -> why it cannot run on a CPU machine without a cluster (what covers it instead)
SKIPPED = {
    "sbatch": "needs a Slurm cluster; tests/e2e/test_slurm.py submits the sbatch files",
    "docker": "needs a Docker engine; tests/e2e/test_compose.py builds and runs the image",
    "docker/build-offline.sh": "needs a Docker engine; tests/e2e/provision.sh builds the image this way",
    "kubectl": "needs a Kubernetes API server; the manifests are validated in test_k8s_manifests.py and their pods "
    "run in tests/e2e/test_k8s_kubelet_emulation.py",
    "export COMPOSE_FILE": "sets up the docker compose lines that follow",
    "make test": "is this test suite",
    "make e2e": "is the e2e suite",
    "make setup": "installs the dev venv this suite runs in",
    "make check": "is this suite's lint and unit tier",
    "make flaky": "reruns the timing-sensitive tier N times (tens of minutes): tests/unit/test_flaky.py checks its counting",
    "ddpjob train --model mypkg": "mypkg stands for the reader's own package",
    "ddpjob launch --nproc-per-node 8 --strategy fsdp2": "8 GPUs and my_pkg, the reader's own package",
    "ddpjob doctor --all-nodes --nnodes": "one agent per node, by hand on several hosts; tests/process/test_preflight_processes.py runs it",
    "ddpjob diagnose runs/ddpjob": "reads the traces of a stuck job; tests/process/test_diagnose.py makes one",
    "ddpjob launch --nnodes": "one agent per node on several hosts; tests/process/test_elastic.py runs them",
    "pip install 'ddpjob[s3]'": "installs the s3 extra, which the dev extra this suite runs in includes",
    "export AWS_ENDPOINT_URL": "names a store of the reader's; the S3 tests start their own (tests/s3server.py)",
    "ddpjob launch --nproc-per-node 2 --checkpoint-dir": "needs the reader's bucket; tests/process/"
    "test_s3_checkpoints.py runs it against a real S3 server (SeaweedFS)",
}


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    text: str
    expect: int


def commands(page: Path) -> list[Command]:
    found = []
    lines = page.read_text().splitlines()
    fence, transcript, i = "", False, 0
    while i < len(lines):
        raw = lines[i]
        if raw.startswith("```"):
            fence = "" if fence else (raw[3:].strip() or "text")
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            transcript = any(line.startswith("$ ") for line in lines[i + 1 : end])
            i += 1
            continue
        start = i
        text = raw
        while text.endswith("\\") and i + 1 < len(lines):  # continuation lines
            i += 1
            text = text[:-1] + " " + lines[i].strip()
        i += 1
        if not fence:
            continue
        if fence in ("sh", "bash") and not transcript:
            cmd = text.strip()
            if not cmd or cmd.startswith("#"):
                continue
        elif text.startswith("$ "):
            cmd = text[2:].strip()
        else:
            continue
        following = lines[i] if i < len(lines) else ""
        expect = 2 if following.startswith("ddpjob: error:") else 0
        found.append(Command(page, start + 1, cmd, expect))
    return found


ALL = [c for page in PAGES for c in commands(page)]


def skip_reason(cmd: str) -> str | None:
    words = re.sub(r"^(\w+=\S+\s+)+", "", cmd)  # VAR=value prefixes
    for prefix in sorted(SKIPPED, key=len, reverse=True):  # the most specific row
        if re.match(re.escape(prefix) + r"(?![\w/-])", words):
            return SKIPPED[prefix]
    return None


def test_the_docs_have_commands_and_every_skip_row_is_used():
    assert len(ALL) > 20
    used = {prefix for c in ALL for prefix in SKIPPED if skip_reason(c.text) == SKIPPED[prefix]}
    assert set(SKIPPED) - used == set(), "rows of SKIPPED that no command needs any more"


def test_every_test_file_the_docs_name_exists():
    """A page that says where a behaviour is tested names a file that is there (tests moved into tiers)."""
    named = {m for page in PAGES for m in re.findall(r"tests/[\w/]+\.py", page.read_text())}
    named |= {m for reason in SKIPPED.values() for m in re.findall(r"tests/[\w/]+\.py", reason)}
    assert named and sorted(m for m in named if not (REPO / m).is_file()) == []


def torch_kind(cmd: Command) -> str | None:
    """The starter kind of a `ddpjob train` or `launch` command that runs and gets as far as importing
    torch (bad input exits before), else None."""
    found = re.match(r"(\w+=\S+\s+)*ddpjob\s+(train|launch)\b", cmd.text)
    if not found or cmd.expect or skip_reason(cmd.text):
        return None
    return "launch" if found[2] == "launch" else "plain"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_on_the_page_runs_as_written(page, tmp_path):
    tree = tmp_path / "repo"  # the page's commands run in a fresh copy of the checkout, as a reader's would
    shutil.copytree(
        REPO, tree, ignore=shutil.ignore_patterns(".git", ".venv*", "runs", ".e2e", "__pycache__", "wheelhouse")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPJOB_", "SLURM_", "PET_"))}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    env.update(
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
        PYTHONPATH=f"{tree / 'src'}:{tree}",
        DDPJOB_DEVICE="cpu",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
    )
    # `ddpjob train` and `launch` are `python -m ddpjob`, forked from a starter that has imported torch
    # (tests/starter.py; test_starter compares the two), of each kind the page runs twice or more (a
    # starter costs about what it saves a command); the tools start afresh, and the Makefile's targets
    # run the venv's console script
    kinds = Counter(kind for c in commands(page) if (kind := torch_kind(c)))
    with starter.shim(tmp_path / "bin", env, sorted(k for k, n in kinds.items() if n > 1)) as shimmed:
        run_the_commands(page, tree, {**env, **shimmed})


def run_the_commands(page: Path, tree: Path, env: dict[str, str]) -> None:
    ran = 0
    for cmd in commands(page):
        if skip_reason(cmd.text):
            continue
        shell = cmd.text
        if shell.startswith("make "):  # the repo's Makefile, results in the scratch dir
            shell = f"make VENV={REPO / '.venv'} {shell[5:]}"
        short = {} if re.search(r"--(epochs|max-steps)\b", shell) else {"DDPJOB_MAX_STEPS": "4"}
        proc = subprocess.run(
            ["bash", "-c", shell], cwd=tree, env={**env, **short}, capture_output=True, text=True, timeout=600
        )
        out = (proc.stdout + proc.stderr)[-3000:]
        assert proc.returncode == cmd.expect, f"{page.name}:{cmd.line}: `{cmd.text}` exited {proc.returncode}\n{out}"
        if cmd.expect:
            assert "Traceback" not in out and out.strip().splitlines()[-1].startswith("ddpjob: error:"), out
        ran += 1
    if not ran:
        pytest.skip("no command on this page runs on a CPU machine")
