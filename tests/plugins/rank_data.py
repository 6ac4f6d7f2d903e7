"""Test plug-ins: data factories as users write them, for the launch agent's elastic data check:
one that reads the rank's environment (as torchrun sets it), one that fails, one that records each
call (in the file $TEST_DATA_CALLS), one that records the random state it finds (a user's factory
that draws before ddpjob seeds)."""

from __future__ import annotations

import os
from collections.abc import Iterator

from torch.utils.data import IterableDataset


class Stream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(())


def ranked_stream() -> Stream:
    """A stream that picks its share when built, from the rank torchrun sets."""
    int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    return Stream()


def failing() -> Stream:
    raise RuntimeError("the data server is down")


def recorded() -> Stream:
    with open(os.environ["TEST_DATA_CALLS"], "a") as f:
        f.write("called\n")
    return Stream()


def seeds_drawn():  # type: ignore[no-untyped-def]
    """Records torch's and numpy's first draws in this process (before ddpjob seeds anything), in
    $TEST_DATA_CALLS, a line per rank; then the synthetic data."""
    import numpy
    import torch

    from ddpjob import plugins

    with open(os.environ["TEST_DATA_CALLS"], "a") as f:
        f.write(f"{os.environ.get('RANK')} {torch.randint(2**62, ()).item()} {numpy.random.randint(2**62)}\n")
    return plugins.synthetic(samples=512)
