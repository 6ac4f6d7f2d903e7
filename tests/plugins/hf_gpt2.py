"""Test plug-in: a tiny Hugging Face GPT-2 built from its config (no download; embedding and output tied)."""

from torch import nn


def config():  # type: ignore[no-untyped-def]
    from transformers import GPT2Config

    return GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)


def model() -> nn.Module:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(config())
