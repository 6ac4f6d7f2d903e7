"""Test plug-in: digits_mlp whose worker counts the gradient reduce-scatters fsdp2 runs, written at
exit to ``reduce-scatters-<rank>`` in the working directory."""

import atexit
import os
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from ddpjob import plugins

COUNT = [0]


def counted(*args: Any, **kwargs: Any) -> Any:
    COUNT[0] += 1
    return REDUCE(*args, **kwargs)


REDUCE = _fsdp_param_group.foreach_reduce


def model() -> nn.Module:
    if _fsdp_param_group.foreach_reduce is not counted:  # once per process, however often the model is built
        _fsdp_param_group.foreach_reduce = counted
        path = Path(f"reduce-scatters-{os.environ.get('RANK', '0')}")
        atexit.register(lambda: path.write_text(str(COUNT[0])))
    return plugins.digits_mlp(dropout=0.0)
