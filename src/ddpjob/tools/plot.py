"""`ddpjob plot RUN_DIR`: loss, held-out accuracy (held-out loss for jobs other than classifiers) and
throughput over steps as one PNG, from metrics.jsonl.

Restarts of the worker group and resumes from a checkpoint are marked with vertical lines. The PNG
goes to a new path or replaces an earlier plot, never another file (outputs.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ddpjob import optional
from ddpjob.checkpoint import atomic_fs
from ddpjob.errors import UsageError
from ddpjob.tools import outputs
from ddpjob.train.metrics import read_records


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UsageError(f"{path} does not exist; pass the run dir (with metrics.jsonl) of a ddpjob run")
    return read_records(path, "plot")  # a line cut by a crash: the rest is still worth plotting


def series(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """What the panels show: label -> (steps, values)."""
    train = [r for r in records if r["event"] == "train"]
    held_out = [r for r in records if r["event"] in ("eval", "final")]
    key = "accuracy" if any("accuracy" in r for r in held_out) else "val_loss"  # classifiers; other jobs
    evals = [r for r in held_out if key in r]
    return {
        "loss": ([r["step"] for r in train], [r["loss"] for r in train]),
        f"held-out {key.replace('val_', '')}": ([r["step"] for r in evals], [r[key] for r in evals]),
        "samples/s": ([r["step"] for r in train], [r["samples_per_s"] for r in train]),
    }


def markers(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(step, kind) of each resume from a checkpoint, worker-group restart and preemption."""
    found = []
    for r in records:
        if r["event"] == "start" and r.get("resumed_from"):
            found.append((r["step"], "resume"))
        if r["event"] == "start" and r.get("restart"):
            found.append((r["step"], "restart"))
        if r["event"] == "preempted":
            found.append((r["step"], "preempted"))
    return found


SOFTWARE = "ddpjob plot"  # the PNG's Software text chunk: the file that a later plot may replace
STYLES = {"resume": ("tab:orange", "--"), "restart": ("tab:red", ":"), "preempted": ("tab:purple", "-.")}


def plot(run_dir: Path, out: Path | None = None) -> Path:
    optional.require("matplotlib", "ddpjob plot").use("Agg")
    plt = optional.require("matplotlib.pyplot", "ddpjob plot")

    path = run_dir / "metrics.jsonl" if run_dir.is_dir() else run_dir
    records = read_metrics(path)
    out = out or path.with_name("metrics.png")
    out = outputs.check(
        out, [path], False, "ddpjob plot writes one PNG (it replaces only an earlier plot)", replaceable=is_plot
    )
    panels = series(records)
    if not panels["loss"][0]:
        raise UsageError(f"{path} has no training records yet; run longer than --log-every steps")
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 9), sharex=True)
    for ax, (label, (steps, values)) in zip(axes, panels.items(), strict=True):
        ax.plot(steps, values, marker="." if len(steps) < 50 else None)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        for step, kind in markers(records):
            color, style = STYLES[kind]
            ax.axvline(step, color=color, linestyle=style, label=kind)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        unique = dict(zip(labels, handles, strict=True))
        axes[0].legend(unique.values(), unique.keys(), loc="upper right")
    axes[-1].set_xlabel("step")
    fig.suptitle(f"ddpjob run {run_dir}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = atomic_fs.temp_name(out)
    try:  # a plot that fails half-way leaves the earlier one
        fig.savefig(tmp, dpi=100, format="png", metadata={"Software": SOFTWARE})
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)
    return out


def is_plot(path: Path) -> bool:
    """Whether path is a PNG that ddpjob plot wrote: its Software text chunk names ddpjob plot (a
    figure the user saved with matplotlib names Matplotlib, and is never replaced)."""
    with path.open("rb") as f:
        head = f.read(4096)
    return head.startswith(b"\x89PNG") and b"tEXtSoftware\x00" + SOFTWARE.encode() in head
