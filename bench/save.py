"""Checkpoint saves: how long the training loop is blocked, asynchronous vs synchronous.

One process, a synthetic MLP of about 1 GiB fp32 with AdamW state (so each checkpoint is about
3 GiB), ddpjob's own Checkpointer, both formats (one .pt file; a DCP folder). Median of
--repeats saves each. Async saves copy the state into host buffers kept between saves (one extra
host copy of the state) and write from a thread; the first save also allocates those buffers.
    python bench/save.py [--repeats 3] [--width 8192] [--depth 5]
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import median, table

from ddpjob.checkpoint.manager import Checkpointer
from ddpjob.config import Config
from ddpjob.distenv import DistEnv
from ddpjob.plugins import synthetic_mlp
from ddpjob.train.setup import Progress


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--depth", type=int, default=5)
    a = parser.parse_args()
    model = synthetic_mlp(width=a.width, depth=a.depth)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the moment buffers
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    env = DistEnv(0, 0, 1, 1, 0, "127.0.0.1", 29500, "single")
    rows, blocked = [], {}
    for fmt, mode in [("file", "sync"), ("file", "async"), ("dcp", "sync"), ("dcp", "async")]:
        with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
            cfg = Config(checkpoint_dir=tmp, keep=1, save_mode=mode, checkpoint_format=fmt)
            stateful = dict(model=model, optimizer=optimizer, scheduler=scheduler, progress=Progress())
            ckpt = Checkpointer(cfg, env)
            ckpt.attach(**stateful)
            block, total = [], []
            for step in range(1, a.repeats + 1):
                start = time.perf_counter()
                ckpt.save(step, 0)
                block.append(time.perf_counter() - start)
                ckpt.wait()  # until the file is on disk
                total.append(time.perf_counter() - start)
            ckpt.close()
            blocked[fmt, mode] = median(block)
            if fmt == "file":
                file_size = max(Path(tmp).glob("step-*.pt")).stat().st_size
            rows.append([f"{fmt} {mode}", median(block), median(total), ", ".join(f"{b:.2f}" for b in block)])
    table(
        f"save: model {size / 2**30:.2f} GiB fp32 + AdamW, checkpoint {file_size / 2**30:.2f} GiB, "
        f"median of {a.repeats}",
        ["mode", "loop blocked (s)", "until on disk (s)", "blocked, each run"],
        rows,
    )
    for fmt in ("file", "dcp"):
        ratio = blocked[fmt, "async"] / blocked[fmt, "sync"]
        print(f"{fmt}: async blocked / sync blocked = {ratio:.3f} (target <= 0.10)")


if __name__ == "__main__":
    main()
