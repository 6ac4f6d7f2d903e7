"""A small causal transformer language model on real text that ships with Python, as a ddpjob plug-in.

    ddpjob train --model examples.lm:tiny_lm --data examples.lm:stdlib_text

``tiny_lm`` is a GPT-style decoder: byte-level tokens (vocabulary 256), learned positions,
pre-norm blocks of causal self-attention (``scaled_dot_product_attention(is_causal=True)``) and
an MLP, and an output head tied to the token embedding (ddpjob's loader detects tied weights
when it builds a model from a checkpoint or ``--init-from``). It follows the Hugging Face
convention: ``forward(input_ids, labels=None)`` returns a dict with ``"logits"`` and, given
labels, ``"loss"``, the mean cross-entropy of predicting each next token; the model shifts the
labels itself, so a batch's labels are its input_ids.

``stdlib_text`` is the corpus: the ``.py`` sources of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), read as bytes in sorted path order. Left out, so that it
is the same on every installation of a Python version: site-packages and dist-packages, the
``test``, ``tests`` and ``idle_test`` folders (the official Docker images delete exactly those),
and the build-specific ``config-*`` folder and ``_sysconfigdata*`` module. Whole files are taken
in path order until ``max_bytes``; every ``1/val_fraction``-th file (fixed, by file, not by byte: files 9, 29, 49, ... with 0.05)
is held out for validation. Nothing is downloaded and it loads in well under a second.

The corpus depends on the Python version (the standard library changes between releases, a
little between patch releases too): with the default arguments, CPython 3.11.7 (this repo's CI
and ``python:3.11-slim`` image use 3.11) gives 109 files, 2,002,841 bytes, from ``__future__.py``
to ``difflib.py``, of which 5 files (91,398 bytes) are held out. ``corpus_files()`` lists them
for any other interpreter.
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

LEFT_OUT_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, block: int, dropout: float) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as GPT-2
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        where = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.tokens(input_ids) + self.positions(where))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if labels is None:
            return {"logits": logits}
        shifted = logits[:, :-1].reshape(-1, logits.shape[-1])  # position i predicts token i + 1
        return {"logits": logits, "loss": F.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=-100)}


def tiny_lm(
    vocab: int = 256, dim: int = 128, layers: int = 4, heads: int = 4, block: int = 128, dropout: float = 0.0
) -> nn.Module:
    """About 0.8M parameters with the defaults."""
    return TinyLM(vocab, dim, layers, heads, block, dropout)


class TokenBlocks(Dataset[dict[str, torch.Tensor]]):
    """Blocks of ``block`` tokens starting every ``stride`` tokens, as {"input_ids", "labels"}."""

    def __init__(self, tokens: torch.Tensor, block: int, stride: int) -> None:
        if len(tokens) < block:
            raise ValueError(f"{len(tokens)} tokens are fewer than one block of {block}")
        self.tokens, self.block, self.stride = tokens, block, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.block) // self.stride + 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        ids = self.tokens[index * self.stride : index * self.stride + self.block].long()
        return {"input_ids": ids, "labels": ids}


def corpus_files(max_bytes: int = 2_000_000) -> list[Path]:
    """The standard library's .py files in the corpus: whole files in sorted path order until max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in LEFT_OUT_DIRS and not (folder == str(root) and d.startswith("config-"))]
        found += [Path(folder, n) for n in names if n.endswith(".py") and not n.startswith("_sysconfigdata")]
    files, total = [], 0
    for path in sorted(found, key=lambda p: p.relative_to(root).as_posix()):
        if total >= max_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    return files


def is_held_out(index: int, val_fraction: float) -> bool:
    """Evenly spread, about len * val_fraction files: file i is held out when (i + 1/2) * val_fraction
    reaches a whole number (with 0.05: files 9, 29, 49, ...)."""
    return math.floor((index + 1) * val_fraction + 0.5) > math.floor(index * val_fraction + 0.5)


def stdlib_text(
    block: int = 128, val_fraction: float = 0.05, max_bytes: int = 2_000_000, stride: int = 0
) -> tuple[TokenBlocks, TokenBlocks]:
    """(train, validation) blocks of byte tokens from the standard library's sources; stride 0: block."""
    train: list[bytes] = []
    val: list[bytes] = []
    for i, path in enumerate(corpus_files(max_bytes)):
        (val if is_held_out(i, val_fraction) else train).append(path.read_bytes())

    def blocks(texts: list[bytes]) -> TokenBlocks:
        tokens = torch.frombuffer(bytearray(b"".join(texts)), dtype=torch.uint8)
        return TokenBlocks(tokens, block, stride or block)

    return blocks(train), blocks(val)
