"""Every random number generator the loop touches: seed them, capture them, restore them.

States are stored as tensors and plain types so that ``torch.load(weights_only=True)`` accepts them.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
