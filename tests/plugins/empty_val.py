"""Test plug-in: training data with an empty validation set (a split that came out empty)."""

import torch
from torch.utils.data import TensorDataset

from ddpjob.plugins import synthetic


def data() -> tuple[TensorDataset, TensorDataset]:
    return synthetic(samples=512), TensorDataset(torch.zeros(0, 256), torch.zeros(0, dtype=torch.long))


class Unsized(torch.utils.data.Dataset):
    """A map-style dataset whose __len__ raises TypeError (as a wrapper of an unsized one does)."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(256), torch.tensor(0)

    def __len__(self) -> int:
        raise TypeError("this dataset has no length")


def unsized_val() -> tuple[TensorDataset, Unsized]:
    return synthetic(samples=512), Unsized()


def unsized_train() -> Unsized:
    return Unsized()
