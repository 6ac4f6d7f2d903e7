"""Checkpoints in an S3 bucket vs a local folder: save and load throughput, and how long an async
save blocks the loop.

One process, a synthetic MLP with AdamW state, ddpjob's own Checkpointer, both formats, sync and
async saves; the bucket is a local SeaweedFS server (``weed mini``, started here as the tests start
it: tests/s3server.py), so the figures are the client's and the protocol's costs, not a network's.
Median of --repeats each.
    python bench/s3.py [--repeats 3] [--width 2048] [--depth 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import REPO, median, table

sys.path.insert(0, str(REPO / "tests"))
from ddpjob.checkpoint import catalogue, storage
from ddpjob.checkpoint.formats import dcp_folder, single_file
from ddpjob.checkpoint.manager import Checkpointer
from ddpjob.config import Config
from ddpjob.distenv import DistEnv
from ddpjob.plugins import synthetic_mlp
from ddpjob.train.setup import Progress
from s3server import BUCKET, S3Server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=4)
    a = parser.parse_args()
    model = synthetic_mlp(width=a.width, depth=a.depth)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the moment buffers
    size = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights + 2 moments
    env = DistEnv(0, 0, 1, 1, 0, "127.0.0.1", 29500, "single")
    rows = []
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        server = S3Server(Path(tmp) / "s3").start()
        os.environ.update(server.env())
        try:
            for where in ("local", "s3"):
                for fmt, mode in [("file", "sync"), ("file", "async"), ("dcp", "sync"), ("dcp", "async")]:
                    directory = f"s3://{BUCKET}/{fmt}-{mode}" if where == "s3" else f"{tmp}/{fmt}-{mode}"
                    if where == "local":
                        Path(directory).mkdir()
                    cfg = Config(checkpoint_dir=directory, keep=1, save_mode=mode, checkpoint_format=fmt)
                    ckpt = Checkpointer(cfg, env)
                    ckpt.attach(model=model, optimizer=optimizer, progress=Progress())
                    ckpt.begin()
                    block, total, load = [], [], []
                    for step in range(1, a.repeats + 1):
                        start = time.perf_counter()
                        ckpt.save(step, 0)
                        block.append(time.perf_counter() - start)
                        ckpt.wait()  # until it is stored and committed
                        total.append(time.perf_counter() - start)
                        path = catalogue.latest_valid(storage.location(directory))
                        start = time.perf_counter()
                        if fmt == "dcp":
                            dcp_folder.load(path, model, optimizer, None, verified=True)
                        else:
                            single_file.read(path, verified=True)
                        load.append(time.perf_counter() - start)
                    ckpt.close()
                    mb = size / 2**20
                    rows.append(
                        [where, f"{fmt} {mode}", median(block), median(total), mb / median(total), mb / median(load)]
                    )
        finally:
            server.stop()
    table(
        f"s3 vs local: checkpoint of {size / 2**20:.0f} MiB (MLP + AdamW), median of {a.repeats}",
        ["store", "mode", "loop blocked (s)", "until stored (s)", "save MiB/s", "load MiB/s"],
        rows,
    )


if __name__ == "__main__":
    main()
