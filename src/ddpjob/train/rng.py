"""Every random number generator the loop touches: seed them, capture them, restore them.

States are stored as tensors and plain types so that ``torch.load(weights_only=True)`` accepts them.

A map-style dataset's randomness (augmentation) is per sample: ``PerSample`` seeds torch's CPU
generator, Python's ``random`` and numpy's global RNG from (seed, epoch, sample index) before each
fetch (each its own seed), so a sample's draws are the same in any process that fetches it: a DataLoader worker or the
rank, at any --num-workers, any world size, and after a resume at any point. In the rank's own
process (no workers) the three generators are put back after each batch: the loop's streams
(dropout) do not depend on the data. ``Keyed`` turns a sampler's indices into the (epoch, index) keys.
A dataset that draws no random numbers (a plain ``TensorDataset``, or one that says
``draws_random_numbers = False``) is fetched as it is. The cost per sample: bench/augment_seed.py.

    dataset, sampler = per_sample(dataset, sampler, seed)   # sampler.epoch: the epoch it iterates
    loader = DataLoader(dataset, sampler=sampler, ...)
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, Sampler, StackDataset, Subset, TensorDataset, get_worker_info

SEEDS = 2**64  # torch takes seeds modulo this (a negative one as its two's complement)


def seed_all(seed: int) -> None:
    """Seed every generator; any int (a seed plus a rank or an epoch may pass torch's range: wrapped)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % SEEDS)


def derived_seed(*parts: int) -> int:
    """A 64-bit seed from several numbers (seed, step, rank): distinct streams, stable across runs."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


def get_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)
    return {
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_initialized() else [],  # this rank's device
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
    }


def set_state(state: dict[str, Any]) -> None:
    """Restore every generator. The torch RNG setters take host byte tensors only, so states that
    were loaded onto a device are brought back first."""
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():  # older checkpoints hold every visible device's
        torch.cuda.set_rng_state(state["cuda"][min(torch.cuda.current_device(), len(state["cuda"]) - 1)].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))


def seed_sample(seed: int) -> None:
    """Seed the generators a dataset's ``__getitem__`` draws from, each apart, from the bits of one
    64-bit sample seed (a SplitMix64 output, all of whose bits look random): torch's CPU generator (not
    CUDA's, which the loop's own streams use) gets all 64, ``torch.initial_seed()``, though its
    Mersenne twister uses the low 32; numpy's global one the high 32 (the same algorithm seeded with
    the low ones would repeat torch's numbers); Python's all 64, through its own seeding algorithm."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed >> 32)


_MASK = 2**64 - 1


def mix64(value: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit numbers whose outputs for neighbours look unrelated."""
    value = (value + 0x9E37_79B9_7F4A_7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK
    return value ^ (value >> 31)


class EpochIndices(Protocol):
    epoch: int

    def __iter__(self) -> Iterator[int]: ...

    def __len__(self) -> int: ...


class Keyed(Sampler[tuple[int, int]]):
    """A sampler's indices as (epoch, index) keys, its ``epoch`` read when an epoch's iteration begins."""

    def __init__(self, sampler: EpochIndices) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.sampler.epoch
        return ((epoch, index) for index in self.sampler)


class PerSample(Dataset[Any]):
    """``dataset`` fetched by (epoch, index) keys, each sample with the generators seeded from (seed,
    epoch, index), the index in ``dataset``. A dataset with its own batched fetch (``batched_fetch``:
    Hugging Face's) keeps it and is seeded once per batch, as its first sample: reproduced at one world
    size (resume, any --num-workers), not at another, whose batches hold other samples."""

    def __init__(self, dataset: Dataset[Any], seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.batched = batched_fetch(dataset)
        self.epoch_seeds: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def sample_seed(self, epoch: int, index: int) -> int:
        """The seed of sample ``index`` in ``epoch``: one hash per epoch, then a cheap mix per sample."""
        if epoch not in self.epoch_seeds:
            self.epoch_seeds[epoch] = derived_seed(self.seed, epoch)
        return mix64(self.epoch_seeds[epoch] + index)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        seed_sample(self.sample_seed(epoch, index))
        return self.dataset[index]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        """A batch; in the rank's own process (no DataLoader workers) the generators are put back
        afterwards, so the loop's own streams (dropout) do not depend on the data."""
        if get_worker_info() is not None:  # a worker's generators serve the dataset only
            return self._fetch(keys)
        saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
        try:
            return self._fetch(keys)
        finally:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])

    def _fetch(self, keys: list[tuple[int, int]]) -> list[Any]:
        if self.batched is None:
            return [self[key] for key in keys]
        seed_sample(self.sample_seed(*keys[0]))
        return list(self.batched([index for _, index in keys]))


FETCHES = ("__getitem__", "__getitems__")


def torch_wrapped(dataset: Dataset[Any]) -> list[Dataset[Any]] | None:
    """The datasets inside one of torch's own wrappers (``Subset``, ``ConcatDataset``, ``StackDataset``,
    or a subclass that fetches as they do), which fetch from them item by item; None for any other."""
    inner: dict[type[Dataset[Any]], Callable[[Any], list[Dataset[Any]]]] = {
        Subset: lambda d: [d.dataset],
        ConcatDataset: lambda d: list(d.datasets),
        StackDataset: lambda d: list(d.datasets.values() if isinstance(d.datasets, dict) else d.datasets),
    }
    kind = type(dataset)
    for wrapper, datasets in inner.items():
        fetches_as_it = all(getattr(kind, name, None) is getattr(wrapper, name, None) for name in FETCHES)
        if isinstance(dataset, wrapper) and fetches_as_it:
            return datasets(dataset)
    return None


def batched_fetch(dataset: Dataset[Any]) -> Callable[[list[int]], Any] | None:
    """The dataset's own ``__getitems__`` where it fetches a batch at once (Hugging Face's); None where
    it has none, or it is torch's wrapper (``Subset``, ``StackDataset``) of datasets that have none:
    theirs passes each item through, so each is seeded on its own."""
    fetch = getattr(dataset, "__getitems__", None)
    inner = torch_wrapped(dataset)
    if fetch is None or (inner is not None and all(batched_fetch(d) is None for d in inner)):
        return None
    return cast(Callable[[list[int]], Any], fetch)


def draws_random_numbers(dataset: Dataset[Any]) -> bool:
    """Whether fetching from ``dataset`` may draw random numbers: unless it says otherwise with a
    ``draws_random_numbers = False`` attribute, or is a plain ``TensorDataset`` (or torch's wrapper of
    datasets that draw none: a ``Subset`` of one, from ``random_split``), which draws none."""
    said = getattr(dataset, "draws_random_numbers", None)
    if said is not None:
        return bool(said)
    inner = torch_wrapped(dataset)
    if inner is not None:
        return any(draws_random_numbers(d) for d in inner)
    return type(dataset) is not TensorDataset


def per_sample(dataset: Dataset[Any], sampler: EpochIndices, seed: int) -> tuple[Dataset[Any], Sampler[Any]]:
    """What a DataLoader takes for per-sample seeding: ``PerSample(dataset)`` and ``Keyed(sampler)``; a
    dataset that draws no random numbers as it is (seeding it would cost for nothing)."""
    if not draws_random_numbers(dataset):
        return dataset, cast(Sampler[int], sampler)
    return PerSample(dataset, seed), Keyed(sampler)
