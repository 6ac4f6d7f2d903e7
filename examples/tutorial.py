"""The model and data of the DataParallel/DDP tutorial ddpjob grew from, as a ddpjob plug-in.

    ddpjob train --model examples.tutorial:model --data examples.tutorial:data

The tutorial moved batches to the GPU in a loop before training, used model.module before
wrapping and passed rank 0 to every process; none of that is needed here: ddpjob wraps, places
and ranks the model, and moves each batch to the right device inside the loop.
"""

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)  # the tutorial's random data, made reproducible
    x_train = torch.randn(1000, 10, generator=gen)
    y_train = torch.randint(0, 5, (1000,), generator=gen)
    return TensorDataset(x_train, y_train)
