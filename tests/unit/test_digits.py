"""The default demo's data: the digits shipped inside the package (src/ddpjob/data), read without
scikit-learn, are exactly scikit-learn's ``load_digits()``, and give the split they gave before."""

import ast
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpjob.plugins import digits, load_digits

if sys.version_info >= (3, 11):
    import tomllib
else:  # a dev dependency on 3.10 (pyproject's dev extra)
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "ddpjob"


def test_bundled_digits_are_scikit_learns_load_digits_exactly():
    datasets = pytest.importorskip("sklearn.datasets")  # a dev extra: the runtime does not have it
    reference = datasets.load_digits()
    pixels, labels = load_digits()
    assert pixels.shape == (1797, 64) and labels.shape == (1797,)
    assert np.array_equal(pixels, reference.data) and np.array_equal(labels, reference.target)


def test_the_digits_split_is_the_one_scikit_learns_arrays_gave():
    """The split and values ``digits()`` gave when it read scikit-learn (its code then, inline)."""
    datasets = pytest.importorskip("sklearn.datasets")
    bunch = datasets.load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n_val = int(len(x) * 0.2)
    before = ((x[order[n_val:]], y[order[n_val:]]), (x[order[:n_val]], y[order[:n_val]]))
    now = digits()
    for old, new in zip(before, now, strict=True):
        for a, b in zip(old, new.tensors, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_every_numpy_load_in_the_package_refuses_pickles_explicitly():
    """A pickled object array in an .npz runs code when loaded: every ``np.load`` of ddpjob says
    ``allow_pickle=False`` itself, rather than trusting numpy's default to stay what it is."""
    calls = [
        (path, node)
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("np.load", "numpy.load")
    ]
    assert calls, "no np.load found: the digits loader changed; update this test"
    unsafe = [
        f"{path.relative_to(PACKAGE)}:{call.lineno}"
        for path, call in calls
        if not any(k.arg == "allow_pickle" and ast.unparse(k.value) == "False" for k in call.keywords)
    ]
    assert not unsafe, f"np.load without allow_pickle=False: {unsafe}"


def test_the_package_and_the_image_declare_the_license_of_every_bundled_data_file():
    """Each NOTICE under src/ddpjob/data names its data's license, e.g. ``(CC BY 4.0)``: pyproject's
    license expression and the image's licenses label both carry it, beside the code's Apache-2.0."""
    expression = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"]
    assert isinstance(expression, str), "[project].license must be an SPDX expression (a string)"
    (label,) = re.findall(
        r'org\.opencontainers\.image\.licenses="([^"]+)"', (REPO / "docker" / "Dockerfile").read_text()
    )
    assert label == expression
    named = {"Apache-2.0"}
    for notice in PACKAGE.glob("data/*NOTICE*"):
        (license_name,) = re.findall(r"^License:.*\(([^)]+)\)", notice.read_text(), re.M)
        named.add(license_name.replace(" ", "-"))
    assert set(expression.split(" AND ")) == named
