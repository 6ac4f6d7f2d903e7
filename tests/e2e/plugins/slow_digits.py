"""Test plug-in for the compose e2e tests, mounted into the containers: the digits data, each
training sample fetched ``delay`` seconds late, so that a job lasts long enough for a test to add
and stop nodes mid-run, without busy CPUs. (The image ships only ddpjob's own plug-ins.)"""

import time
from typing import Any

from torch.utils.data import Dataset

from ddpjob import plugins


class Slow(Dataset):
    def __init__(self, base: Any, delay: float) -> None:
        self.base, self.delay = base, delay

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.delay)
        return self.base[index]


def digits(delay: float = 0.02) -> tuple[Slow, Any]:
    train, val = plugins.digits()
    return Slow(train, delay), val
