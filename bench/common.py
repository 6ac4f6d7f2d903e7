"""Shared by the benchmark scripts: running commands, medians, and printing a table."""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def env(**extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DDPJOB_", "SLURM_", "PET_"))}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        clean.pop(key, None)
    return {**clean, "PYTHONPATH": f"{REPO / 'src'}:{REPO}", **extra}


def run(cmd: Sequence[str], cwd: Path, timeout: float = 1800, **extra: str) -> str:
    proc = subprocess.run(list(cmd), cwd=cwd, env=env(**extra), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def torchrun(nproc: int, *args: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def ddpjob_train(work: Path, model: str, data: str, *args: str, **environ: str) -> None:
    """`ddpjob train` on 2 processes under torchrun, run dir `work`, fresh start, ``environ`` added."""
    work.mkdir(parents=True, exist_ok=True)
    run(
        torchrun(
            2,
            "-m",
            "ddpjob",
            "train",
            "--model",
            model,
            "--data",
            data,
            "--resume",
            "never",
            "--run-dir",
            str(work),
            *args,
        ),
        cwd=work,
        **environ,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [list(map(str, header))] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, row in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    sys.stdout.flush()
