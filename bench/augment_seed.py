"""The cost of per-sample seeding (ddpjob.train.rng.PerSample): what seeding torch's, Python's and numpy's
generators from (seed, epoch, index) adds to each fetch of a map-style dataset, in µs per sample, and
the ratio to a plain fetch. First the overhead alone (each generator's seeding apart); then three
datasets: a row of the digits tensors (the cheapest fetch there is, so the worst ratio; a real
TensorDataset draws nothing and ddpjob does not seed it), a pre-tokenized dict of 128 tokens (draws
nothing: what ``draws_random_numbers = False`` saves) and 3x32x32 images with a random crop, flip and
noise (an augmentation). Two places: a DataLoader worker (seeding only) and the rank's own process at
--num-workers 0 (seeding, and the generators saved and put back once per batch), at each batch size.
    python bench/augment_seed.py [--samples 2000] [--repeats 15] [--batches 32,256]
"""

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from common import median, table
from torch.utils.data import Dataset

from ddpjob import plugins
from ddpjob.train.rng import PerSample, seed_sample


class Images(Dataset):
    """CIFAR-sized images, augmented at each fetch: a random 28x28 crop, a random flip, noise."""

    def __init__(self, samples: int) -> None:
        self.x = torch.rand(samples, 3, 32, 32, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> torch.Tensor:
        top, left = random.randrange(5), int(torch.randint(5, ()))
        image = self.x[index, :, top : top + 28, left : left + 28]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image + 0.01 * torch.randn_like(image)


class Tokens(Dataset):
    """Pre-tokenized text: a dict of input_ids and labels per sample, drawing no random numbers."""

    def __init__(self, samples: int) -> None:
        self.ids = torch.randint(0, 50_000, (samples, 128), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def passes_us(
    fetches: dict[str, Callable[[list[int]], Any]], samples: int, batch: int, repeats: int
) -> dict[str, float]:
    """Median over ``repeats`` passes of µs per sample for each fetch, fetching ``samples`` in batches of
    ``batch``; the fetches take turns within each repeat, so a change in the machine's load hits all alike."""
    batches = [list(range(at, min(at + batch, samples))) for at in range(0, samples, batch)]
    times: dict[str, list[float]] = {name: [] for name in fetches}
    for _ in range(repeats):
        for name, fetch in fetches.items():
            start = time.perf_counter()
            for indices in batches:
                fetch(indices)
            times[name].append((time.perf_counter() - start) / samples * 1e6)
    return {name: median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batches", default="32,256", help="batch sizes, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    probe = PerSample(Images(1), seed=0)
    seeds = [probe.sample_seed(1, i) for i in range(args.samples)]
    alone = passes_us(
        {
            "all three": lambda indices: [seed_sample(probe.sample_seed(1, i)) for i in indices],
            "torch": lambda indices: [torch.default_generator.manual_seed(seeds[i]) for i in indices],
            "python": lambda indices: [random.seed(seeds[i]) for i in indices],
            "numpy": lambda indices: [np.random.seed(seeds[i] >> 32) for i in indices],
        },
        args.samples,
        32,
        args.repeats,
    )
    table(
        f"seeding alone, µs per sample (median of {args.repeats} passes)",
        ["torch, Python and numpy (what ddpjob does)", "torch's alone", "Python's alone", "numpy's alone"],
        [[alone["all three"], alone["torch"], alone["python"], alone["numpy"]]],
    )
    datasets = (
        ("a tensor row (the cheapest fetch)", plugins.digits()[0]),
        ("a dict of 128 tokens (draws nothing)", Tokens(args.samples)),
        ("3x32x32 image, crop+flip+noise", Images(args.samples)),
    )
    for batch in map(int, args.batches.split(",")):
        restore = passes_us({"": lambda indices: probe.__getitems__([])}, args.samples, batch, args.repeats)[""]
        rows = []
        for name, dataset in datasets:
            seeded = PerSample(dataset, seed=0)
            got = passes_us(
                {
                    "plain": lambda indices, dataset=dataset: [dataset[i] for i in indices],
                    "worker": lambda indices, seeded=seeded: [seeded[(1, i)] for i in indices],  # as in a worker
                    "rank": lambda indices, seeded=seeded: seeded.__getitems__([(1, i) for i in indices]),  # no worker
                },
                min(args.samples, len(dataset)),
                batch,
                args.repeats,
            )
            base = got["plain"]
            rows.append(
                [name, base, got["worker"] - base, got["worker"] / base, got["rank"] - base, got["rank"] / base]
            )
        table(
            f"batches of {batch}: a fetch with per-sample seeding, µs per sample (median of {args.repeats} passes); "
            f"the rank's save + restore alone: {restore * batch:.3g} µs per batch, {restore:.3g} per sample",
            ["dataset", "plain fetch", "+ seeding (worker)", "x plain", "+ seeding (rank's process)", "x plain"],
            rows,
        )


if __name__ == "__main__":
    main()
