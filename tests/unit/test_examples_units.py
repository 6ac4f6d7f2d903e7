"""The examples of "any training job": a language model on the standard library's sources, a
Hugging Face model from a config, a regression with its own loss. (The tutorial with its SGD
settings: tests/test_any_job.py.)

(The tests of test_examples.py that run in this process.)
"""

from __future__ import annotations

import math

import torch
from examples import lm


def test_stdlib_text_is_the_same_every_time_and_holds_out_whole_files():
    files = lm.corpus_files(max_bytes=300_000)
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "test", "tests"} & set(f.parts) for f in files)
    held = [f for i, f in enumerate(files) if lm.is_held_out(i, 0.05)]
    assert len(held) == math.floor(len(files) * 0.05 + 0.5) > 0

    train, val = lm.stdlib_text(block=16, max_bytes=300_000)
    again, val_again = lm.stdlib_text(block=16, max_bytes=300_000)
    assert torch.equal(train.tokens, again.tokens) and torch.equal(val.tokens, val_again.tokens)
    assert bytes(val.tokens.tolist()) == b"".join(f.read_bytes() for f in held)  # the held-out files, whole
    assert len(train.tokens) + len(val.tokens) == sum(f.stat().st_size for f in files)

    item = train[3]
    assert set(item) == {"input_ids", "labels"} and item["input_ids"].dtype == torch.long
    assert torch.equal(item["input_ids"], item["labels"]) and item["input_ids"].shape == (16,)
    assert bytes(item["input_ids"].tolist()) == bytes(train.tokens[48:64].tolist())  # non-overlapping blocks
    assert len(train) == len(train.tokens) // 16


def test_tiny_lm_loss_is_next_token_cross_entropy_and_attention_is_causal():
    torch.manual_seed(0)
    model = lm.tiny_lm(dim=32, layers=2, heads=2, block=16).eval()
    ids = torch.randint(0, 256, (2, 16))
    out = model(ids, labels=ids)
    expected = torch.nn.functional.cross_entropy(out["logits"][:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    assert torch.allclose(out["loss"], expected)
    later = ids.clone()
    later[:, 10:] = (later[:, 10:] + 1) % 256
    logits = model(later)["logits"]
    assert "loss" not in model(later)
    assert torch.equal(logits[:, :10], out["logits"][:, :10])  # no position sees the future
    assert not torch.equal(logits[:, 10:], out["logits"][:, 10:])
