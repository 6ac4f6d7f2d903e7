"""Test plug-ins for the numbers ddpjob reports and reproduces: a dataset with random augmentation
(noise from torch's, Python's and numpy's global RNGs in ``__getitem__``), a small classifier with
dropout, and a validation set whose labels are all ignored (-100).

With TEST_SAMPLES_DIR set, every fetch of the augmenting dataset appends ``INDEX DIGEST`` (the
sha256 of the augmented input) to TEST_SAMPLES_DIR/<pid>.txt, the file of the process that fetched
it (a DataLoader worker or the rank), so a test can compare each sample's augmentation across runs.
"""

import hashlib
import os
import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

FEATURES, CLASSES = 8, 4


def points(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=gen)
    return x, (x @ torch.randn(FEATURES, CLASSES, generator=gen)).argmax(1)


class Noisy(Dataset):
    """Points with noise added at every fetch, from each of the three global RNGs."""

    def __init__(self, samples: int) -> None:
        self.x, self.y = points(samples, 0)
        self.record = os.environ.get("TEST_SAMPLES_DIR")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.rand(FEATURES) + random.random() + float(np.random.rand())
        x = self.x[index] + 0.1 * noise
        if self.record:
            with open(os.path.join(self.record, f"{os.getpid()}.txt"), "a") as f:
                f.write(f"{index} {hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]}\n")
        return x, self.y[index]


def noisy(samples: int = 96) -> Noisy:
    """Training data only (no validation set)."""
    return Noisy(samples)


def classifier(dropout: float = 0.2) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, CLASSES))


def unlabelled_val(samples: int = 64) -> tuple[Any, TensorDataset]:
    """Training points with labels, and a validation set whose labels are all -100 (ignored)."""
    x, y = points(samples, 0)
    return TensorDataset(x, y), TensorDataset(x[:16], torch.full((16,), -100))


def cross_entropy(output: torch.Tensor, batch: Any) -> torch.Tensor:
    """A user's --loss: plain cross-entropy, which is NaN on a batch whose labels are all -100."""
    return nn.functional.cross_entropy(output, batch[1])


def with_samples_extra(output: torch.Tensor, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """A user's --loss whose extra metric is named ``samples`` (a name ddpjob's records do not use)."""
    return nn.functional.cross_entropy(output, batch[1]), {"samples": float(len(batch[1]))}
