"""The job image: its size, what its layers above the base hold (torch and its own requirements vs
the rest), and seconds from `docker run` to the first training step. Needs a Docker engine and a
built image (docker/build-offline.sh or `docker build -f docker/Dockerfile`).
    python bench/image.py [--image ddpjob:cpu] [--base python:3.11-slim-bookworm] [--repeats 3]
"""

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from common import median, table

# Run inside the image: the size of each distribution installed in /opt/ddpjob (its RECORD files),
# and the closure of torch's requirements.
SIZES = r"""
import importlib.metadata as md, json, re
sizes, requires = {}, {}
for dist in md.distributions():
    name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
    paths = [f.locate() for f in dist.files or []]
    size = sum(p.stat().st_size for p in paths if str(p).startswith("/opt/ddpjob/") and p.is_file())
    if size:
        sizes[name] = size
        requires[name] = [re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r).group(0)).lower()
                          for r in dist.requires or [] if "extra ==" not in r]
closure, todo = set(), ["torch"]
while todo:
    name = todo.pop()
    if name in sizes and name not in closure:
        closure.add(name)
        todo += requires[name]
print(json.dumps({"sizes": sizes, "torch": sorted(closure)}))
"""


def docker(*args: str) -> str:
    return subprocess.run(["docker", *args], check=True, capture_output=True, text=True).stdout


def mb(n: float) -> float:
    return round(n / 1e6, 1)


def layers(image: str, base: str) -> None:
    size, base_size = (int(docker("image", "inspect", "-f", "{{.Size}}", name)) for name in (image, base))
    history = docker("history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", image).splitlines()
    print(f"\nimage {image}: {mb(size)} MB; base {base}: {mb(base_size)} MB; above the base: {mb(size - base_size)} MB")
    print("layers, newest first (docker history):")
    for line in history:
        layer_size, created = line.split("\t", 1)
        print(f"  {layer_size:>10}  {created[:110]}")
    found = json.loads(docker("run", "--rm", "--entrypoint", "/opt/ddpjob/bin/python", image, "-c", SIZES))
    sizes, torch = found["sizes"], set(found["torch"])
    venv = int(docker("run", "--rm", "--entrypoint", "du", image, "-sb", "/opt/ddpjob").split()[0])
    in_torch = sum(sizes[n] for n in torch)
    rows = [[n, mb(s), "torch" if n in torch else "above torch"] for n, s in sorted(sizes.items(), key=lambda x: -x[1])]
    rows.append(["(other files in /opt/ddpjob: venv, examples, .pyc)", mb(venv - sum(sizes.values())), "above torch"])
    table("/opt/ddpjob, the layer above the base, by distribution (MB)", ["distribution", "MB", "group"], rows)
    print(f"\ntorch and its requirements: {mb(in_torch)} MB; above torch: {mb(venv - in_torch)} MB (of {mb(venv)} MB)")


def first_step(image: str, repeats: int) -> None:
    ready, stepped, bare = [], [], []
    for _ in range(repeats):
        t0 = time.time()
        docker("run", "--rm", "--entrypoint", "true", image)
        bare.append(time.time() - t0)
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp).chmod(0o777)  # the image's user (uid 1000) writes its run dir there
            t0 = time.time()
            docker("run", "--rm", "--init", "--shm-size", "1g", "-v", f"{tmp}:/runs", image, "--max-steps", "1")
            records = [json.loads(line) for line in next(Path(tmp).rglob("metrics.jsonl")).read_text().splitlines()]
            ready.append(next(r["time"] for r in records if r["event"] == "start") - t0)
            stepped.append(next(r["time"] for r in records if r["event"] == "train") - t0)
    rows = [
        ["docker run of `true` (container start and exit)", median(bare), ", ".join(f"{v:.2f}" for v in bare)],
        ["ddpjob launch: ready for step 1", median(ready), ", ".join(f"{v:.2f}" for v in ready)],
        ["ddpjob launch: step 1 done", median(stepped), ", ".join(f"{v:.2f}" for v in stepped)],
    ]
    table(f"seconds from `docker run` ({image}, digits demo, 1 CPU process)", ["what", "median (s)", "runs"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--image", default="ddpjob:cpu")
    parser.add_argument("--base", default="python:3.11-slim-bookworm")
    parser.add_argument("--repeats", type=int, default=3)
    a = parser.parse_args()
    layers(a.image, a.base)
    first_step(a.image, a.repeats)


if __name__ == "__main__":
    main()
