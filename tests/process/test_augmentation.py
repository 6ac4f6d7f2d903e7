"""Random augmentation in a map-style dataset is reproduced exactly: each sample's randomness is a
function of (--seed, epoch, sample index), so a run stopped anywhere (mid-epoch, at an epoch's end)
and resumed ends bitwise equal to an uninterrupted one, at any --num-workers, and every sample gets
the same augmentation at any world size. The dataset (tests/plugins/numeric_jobs.py) draws its noise from
torch's, Python's and numpy's global RNGs, as augmentation code does; the model has dropout."""

import random
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, StackDataset, Subset

from ddpjob.train import rng
from helpers import assert_bitwise_equal, ddpjob, final_params, launched, ok, records
from plugins import numeric_jobs as plugins_numbers

P = "tests.plugins.numeric_jobs"
# 96 samples, a global batch of 16: 6 steps an epoch, 12 in all; 2 micro-batches per step at world 1
JOB = ["--model", f"{P}:classifier", "--data", f"{P}:noisy", "--batch-size", "8", "--global-batch-size", "16"]
JOB += ["--epochs", "2", "--save-every", "0", "--log-every", "1000"]


def test_a_run_with_random_augmentation_resumes_bitwise_wherever_it_stopped_at_any_num_workers(work):
    """An uninterrupted run without workers, and a run in three legs: without workers to step 3 (mid-epoch
    0), then with 2 persistent workers to step 6 (the end of epoch 0), then with 2 workers to the end. A
    resume mid-epoch and at an epoch's end, and a change of --num-workers, each change nothing, bit for bit."""
    ok(ddpjob(["train", *JOB, "--num-workers", "0", "--run-dir", "whole"], work))
    for workers, stop in (("0", "3"), ("2", "6"), ("2", "0")):
        ok(ddpjob(["train", *JOB, "--num-workers", workers, "--run-dir", "split", "--max-steps", stop], work))
    assert [r["step"] for r in records(work / "split") if r["event"] == "start"] == [0, 3, 6]
    assert_bitwise_equal(final_params(work / "split"), final_params(work / "whole"))


def test_each_sample_gets_the_same_augmentation_at_any_world_size_and_num_workers(work):
    seen = {}
    for world, workers in ((1, 0), (2, 2)):
        samples = work / f"samples{world}"
        samples.mkdir()
        flags = [*JOB, "--num-workers", str(workers), "--run-dir", f"world{world}"]
        env = {"TEST_SAMPLES_DIR": str(samples)}
        ok(ddpjob(["train", *flags], work, **env) if world == 1 else launched(flags, work, **env))
        seen[world] = Counter(line for path in samples.glob("*.txt") for line in path.read_text().splitlines())
    assert sum(seen[1].values()) == 2 * 96 and len({line.split()[0] for line in seen[1]}) == 96
    assert seen[1] == seen[2]  # (index, digest of the augmented input) pairs


class Batched(torch.utils.data.Dataset):
    """A dataset with its own batched fetch (as Hugging Face's): one draw per batch."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        raise AssertionError("fetched one by one")

    def __getitems__(self, indices):
        noise = torch.rand(())
        return [index + noise for index in indices]


def test_per_sample_seeding_leaves_the_ranks_own_generators_where_they_were():
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    expected = torch.rand(()), random.random(), np.random.rand()
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    dataset, _ = rng.per_sample(plugins_numbers.noisy(8), [], seed=0)
    first = dataset.__getitems__([(0, 3), (0, 5)])
    assert (torch.rand(()), random.random(), np.random.rand()) == expected
    again = dataset.__getitems__([(0, 5), (0, 3)])  # the same samples in another batch, in another order
    assert torch.equal(first[0][0], again[1][0]) and torch.equal(first[1][0], again[0][0])
    assert not torch.equal(first[0][0], dataset.__getitems__([(1, 3)])[0][0])  # another epoch: other draws


def test_a_batched_dataset_keeps_its_getitems_and_one_that_draws_nothing_is_fetched_as_it_is():
    dataset, _ = rng.per_sample(Batched(), [], seed=0)
    assert dataset.__getitems__([(0, 2), (0, 3)]) == dataset.__getitems__([(0, 2), (0, 3)])
    tensors = torch.utils.data.TensorDataset(torch.zeros(4))
    assert rng.per_sample(tensors, [], seed=0)[0] is tensors
    declared = Batched()
    declared.draws_random_numbers = False
    assert rng.per_sample(declared, [], seed=0)[0] is declared


class Order:
    """An epoch's sample order, as batching.EpochSampler gives it: ``epoch`` set before each pass."""

    epoch = 0

    def __iter__(self):
        return iter(range(4))

    def __len__(self):
        return 4


def test_each_sample_and_each_epoch_gets_its_own_draws_and_the_same_key_the_same_draws():
    """Through the DataLoader and the keyed sampler, as training fetches: the noise added to samples
    0..3 (fetched minus stored) differs between samples and between epochs, and repeats for an epoch."""
    base, order = plugins_numbers.noisy(8), Order()
    dataset, keys = rng.per_sample(base, order, seed=0)

    def noise(epoch):
        order.epoch = epoch
        (x, _), *rest = DataLoader(dataset, sampler=keys, batch_size=4)
        assert not rest
        return x - base.x[:4]

    first, again, other = noise(1), noise(1), noise(2)
    assert torch.equal(first, again)
    assert all(not torch.allclose(first[i], first[j]) for i in range(4) for j in range(i))  # each sample its own
    assert all(not torch.allclose(a, b) for a, b in zip(first, other, strict=True))  # each epoch its own


WRAPPERS = {  # a wrapper of torch's, and how to get the input back from its item
    "Subset": (lambda d: Subset(d, range(len(d))), lambda item: item[0]),
    "StackDataset": (lambda d: StackDataset(d), lambda item: item[0][0]),
}


@pytest.mark.parametrize("name", WRAPPERS)
def test_a_sample_of_a_wrapped_augmenting_dataset_gets_the_same_draws_in_any_batch(name):
    """torch's Subset and StackDataset define __getitems__ but fetch item by item: each sample is seeded
    on its own, so its draws do not depend on its batch-mates (the same at any world size)."""
    wrap, unwrap = WRAPPERS[name]
    base = plugins_numbers.noisy(8)
    dataset, _ = rng.per_sample(wrap(base), [], seed=0)
    first = unwrap(dataset.__getitems__([(0, 3), (0, 5)])[0])
    second = unwrap(dataset.__getitems__([(0, 2), (0, 3)])[1])
    assert torch.equal(first, second) and not torch.equal(first, base.x[3])


def test_a_subset_of_a_batched_dataset_keeps_the_batched_fetch_and_one_of_tensors_is_not_seeded():
    dataset, _ = rng.per_sample(Subset(Batched(), range(8)), [], seed=0)
    assert dataset.__getitems__([(0, 2), (0, 3)]) == dataset.__getitems__([(0, 2), (0, 3)])  # not item by item
    tensors = Subset(torch.utils.data.TensorDataset(torch.zeros(4)), range(2))
    assert rng.per_sample(tensors, [], seed=0)[0] is tensors


def test_torch_numpy_and_python_get_independent_seeds():
    """Each generator is seeded apart: the same sample's draws from torch's and numpy's Mersenne
    twisters (the same algorithm) are not the same numbers."""
    rng.seed_sample(rng.mix64(12345))
    torch_draws = torch.randint(0, 2**31, (4,)).tolist()
    numpy_draws = np.random.randint(0, 2**31, 4).tolist()
    python_draws = [random.getrandbits(31) for _ in range(4)]
    assert len({*torch_draws, *numpy_draws, *python_draws}) == 12
