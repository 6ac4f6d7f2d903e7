"""Test plug-in: the digits data, noting at the first sample fetched (the start of step 1) which
modules of torch's sharded stack (DTensor, FSDP2, distributed checkpoint) the process has imported
by then, in OUT as one JSON list."""

import json
import sys
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from ddpjob import plugins

SHARDED = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint")


def sharded_modules() -> list[str]:
    return sorted(m for m in sys.modules if m.startswith(SHARDED))


class Probe(Dataset):
    def __init__(self, base: Any, out: str) -> None:
        self.base, self.out, self.noted = base, Path(out), False

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Any:
        if not self.noted:
            self.noted = True
            self.out.write_text(json.dumps(sharded_modules()))
        return self.base[index]


def digits(out: str) -> tuple[Probe, Any]:
    train, val = plugins.digits()
    return Probe(train, out), val
