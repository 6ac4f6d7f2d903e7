"""Model and data plug-ins: ``MODULE:CALLABLE[(k=v, ...)]`` loading, and the built-in ones.

A model factory returns an ``nn.Module``. A data factory returns a training ``Dataset`` (items: an
``(input, label)`` pair, a dict of tensors, a tensor, or nested mixes; see train/batches.py and train/losses.py),
or a ``(train, validation)`` tuple; either may be an ``IterableDataset`` (a stream: the contract is in
train/feeds.py). Losses, optimizers and schedules load the same way (train/losses.py, train/optim.py).

Built in:
- ``digits_mlp`` / ``digits``: a small classifier on UCI's handwritten digits (1797 8x8 images,
  shipped inside the package as data/digits.npz, 45 KB; source and license in data/NOTICE).
- ``synthetic_mlp`` / ``synthetic``: a model and random dataset of any size, for benchmarks.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from importlib import resources
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from ddpjob.errors import Retriable, UsageError, first_line, is_transient


def parse_spec(spec: str) -> tuple[str, str, dict[str, Any]]:
    """``pkg.mod:fn(width=8, depth=2)`` -> ("pkg.mod", "fn", {"width": 8, "depth": 2})."""
    module, _, call = spec.partition(":")
    name, _, rest = call.partition("(")
    kwargs: dict[str, Any] = {}
    if rest:
        try:
            node = ast.parse(f"f({rest}", mode="eval").body
            assert isinstance(node, ast.Call) and not node.args
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except (SyntaxError, ValueError, AssertionError):
            raise UsageError(f"{spec!r}: arguments must be literals like fn(width=64, name='x')") from None
    return module, name, kwargs


def load_callable(spec: str) -> Callable[[], Any]:
    """Import the factory named by spec; the current directory is importable, as with python -m.
    Calling it, an error of the factory's is one line naming it: bad input (UsageError), or
    retriable where it is a transient I/O or network error (a restart may succeed)."""
    fn, kwargs = _resolve(spec)

    def call() -> Any:
        try:
            return fn(**kwargs)
        except (UsageError, Retriable):
            raise
        except Exception as exc:
            said = f"the factory {spec!r} failed: {type(exc).__name__}: {first_line(exc)}"
            if is_transient(exc):
                raise Retriable(f"{said}; a transient error: a restart retries") from None
            raise UsageError(
                f"{said}; fix its arguments or what it reads, and run it alone to see the traceback"
            ) from None

    return call


def load_function(spec: str) -> Callable[..., Any]:
    """The function named by spec with its ``(k=v)`` arguments bound; the caller passes the rest
    (a loss gets ``(output, batch)``, an optimizer factory the model)."""
    fn, kwargs = _resolve(spec)
    return functools.partial(fn, **kwargs)


def _check_arguments(fn: Callable[..., Any], kwargs: dict[str, Any], spec: str) -> None:
    """A keyword the factory does not take (a typo: ``digits_mlp(hiden=32)``) is one line naming what it takes."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its call reports it
        return
    try:
        signature.bind_partial(**kwargs)
    except TypeError as exc:
        takes = ", ".join(p for p in signature.parameters if p not in ("self", "args", "kwargs")) or "no arguments"
        raise UsageError(f"{spec!r}: {exc}; {spec.partition('(')[0]} takes {takes}") from None


def _resolve(spec: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    module_name, name, kwargs = parse_spec(spec)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import {module_name!r} for {spec!r}: {exc}; check the module path") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"{module_name!r} has no callable {name!r}; check the name after ':' in {spec!r}")
    _check_arguments(fn, kwargs, spec)
    return fn, kwargs


def build_model(spec: str) -> nn.Module:
    model = load_callable(spec)()
    if not isinstance(model, nn.Module):
        raise UsageError(f"model factory {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def size_of(dataset: Any) -> int | None:
    """len(dataset), or None for a dataset without one: no __len__, or one that raises TypeError
    (a wrapper of an unsized dataset does, as Python's len() of an object with no length)."""
    try:
        return len(dataset) if hasattr(dataset, "__len__") else None
    except TypeError:
        return None


def build_data(spec: str) -> tuple[Dataset[Any], Dataset[Any] | None]:
    data = load_callable(spec)()
    train, val = data if isinstance(data, tuple) else (data, None)
    if val is not None and not isinstance(val, IterableDataset) and size_of(val) == 0:
        raise UsageError(  # found now, not after the first epoch
            f"data factory {spec!r} returned an empty validation dataset; give it samples (the built-in digits: "
            "val_fraction > 0), or, for a factory of your own, return the training set alone (no evaluation)"
        )
    if isinstance(train, IterableDataset):  # a stream: its length, if any, is not used (train/feeds.py)
        return train, val
    if not size_of(train):
        raise UsageError(f"data factory {spec!r} returned an empty or unsized training dataset")
    return train, val


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The bundled digits as uint8: pixels (1797, 64), each 0..16, and labels (1797,), each 0..9;
    the values and order of scikit-learn's ``load_digits()``."""
    with (
        resources.files("ddpjob").joinpath("data/digits.npz").open("rb") as f,
        np.load(f, allow_pickle=False) as arrays,
    ):
        return arrays["pixels"], arrays["labels"]


def digits(val_fraction: float = 0.2) -> tuple[TensorDataset, TensorDataset]:
    """The bundled 8x8 digits, scaled to [0, 1], split with a fixed permutation."""
    pixels, labels = load_digits()
    x = torch.from_numpy(pixels).to(torch.float32) / 16.0
    y = torch.from_numpy(labels).to(torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n_val = int(len(x) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def digits_mlp(hidden: int = 128, dropout: float = 0.1) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def synthetic(samples: int = 4096, features: int = 256, classes: int = 10) -> TensorDataset:
    """Random inputs with labels from a fixed random projection, so the loss can fall."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, features, generator=gen)
    y = (x @ torch.randn(features, classes, generator=gen)).argmax(dim=1)
    return TensorDataset(x, y)


def synthetic_mlp(features: int = 256, width: int = 1024, depth: int = 2, classes: int = 10) -> nn.Module:
    """An MLP of any size: about depth * width**2 parameters."""
    layers: list[nn.Module] = [nn.Linear(features, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))
