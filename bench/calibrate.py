"""How fast this machine is now: one fixed piece of single-core work, timed, so that figures taken
on different machines or in different hours (the shared VMs differ by 50% and more) can be set side
by side. Prints the best of 5 runs in seconds: lower is faster. docs/development.md gives each
figure of its table with the calibration of the machine that took it.

    .venv/bin/python bench/calibrate.py
"""

from __future__ import annotations

import time

import torch


def work() -> float:
    """A mix like the tests': torch on one thread (matmuls and a small MLP step) and plain Python."""
    start = time.perf_counter()
    a = torch.randn(256, 256)
    for _ in range(200):
        a = torch.tanh(a @ a)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    for _ in range(200):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    total = 0
    for i in range(1_000_000):
        total += i % 7
    return time.perf_counter() - start


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    work()  # warm-up
    print(f"calibration: {min(work() for _ in range(5)):.2f} s (best of 5; lower is faster)")


if __name__ == "__main__":
    main()
