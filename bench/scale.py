"""Start-up vs number of nodes: N `ddpjob launch` agents on this host (1 process each, c10d
rendezvous on 127.0.0.1, the tutorial's tiny model), timing rendezvous, the first and the tenth
step from the moment the agents are started.
    python bench/scale.py [--nodes 2,4,8,16,32]
Each N needs about 0.6 GiB of memory per node; an N that does not fit in MemAvailable is skipped.
"""

import argparse
import json
import re
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

from common import PY, env, free_port, table

GIB_PER_NODE = 0.6


def mem_available_gib() -> float:
    line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemAvailable"))
    return int(line.split()[1]) / 2**20


def rendezvous_done(log: str, day: datetime) -> float | None:
    """Wall time of torchrun's 'Rendezvous complete' log line (glog prefix: I1130 02:05:07.123456)."""
    found = re.findall(r"^I\d{4} (\d\d:\d\d:\d\d\.\d+) .*Rendezvous complete", log, re.MULTILINE)
    if not found:
        return None
    t = datetime.strptime(found[0], "%H:%M:%S.%f")
    return day.replace(hour=t.hour, minute=t.minute, second=t.second, microsecond=t.microsecond).timestamp()


def run_nodes(n: int) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        port, day = free_port(), datetime.now()
        args = [
            "--model",
            "examples.tutorial:model",
            "--data",
            "examples.tutorial:data",
            "--max-steps",
            "10",
            "--log-every",
            "1",
            "--save-every",
            "0",
            "--rdzv-timeout",
            "600",
            "--run-dir",
            tmp,
        ]
        t0 = time.time()
        agents = [
            subprocess.Popen(
                [PY, "-m", "ddpjob", "launch", *args],
                cwd=tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env(
                    DDPJOB_NNODES=str(n),
                    DDPJOB_NODE_RANK=str(i),
                    LOGLEVEL="INFO",
                    DDPJOB_RDZV_ENDPOINT=f"127.0.0.1:{port}",
                    OMP_NUM_THREADS="1",
                ),
            )
            for i in range(n)
        ]
        logs = [a.communicate(timeout=1800)[0] for a in agents]
        if any(a.returncode for a in agents):
            raise SystemExit(
                f"N={n} failed:\n" + next(log for a, log in zip(agents, logs, strict=True) if a.returncode)
            )
        rdzv = max(t for log in logs if (t := rendezvous_done(log, day)) is not None)
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        step = {r["step"]: r["time"] for r in records if r["event"] == "train"}
        return rdzv - t0, step[1] - t0, step[10] - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", default="2,4,8,16,32")
    a = parser.parse_args()
    rows = []
    for n in map(int, a.nodes.split(",")):
        if mem_available_gib() < n * GIB_PER_NODE:
            rows.append([n, "skipped", f"needs ~{n * GIB_PER_NODE:.0f} GiB", f"{mem_available_gib():.0f} GiB free", ""])
            continue
        rdzv, first, tenth = run_nodes(n)
        rows.append([n, rdzv, first, tenth, first / n])
    table(
        "scale: N agents x 1 process on one host (2 cores), seconds from starting the agents",
        ["N", "rendezvous done", "step 1", "step 10", "step 1 / N"],
        rows,
    )


if __name__ == "__main__":
    main()
