"""A Hugging Face ``transformers`` model built from a config (nothing downloaded), as a ddpjob plug-in.

    pip install 'ddpjob[hf]'
    ddpjob train --model examples.hf_tiny:tiny_gpt2 --data examples.lm:stdlib_text

``GPT2LMHeadModel`` takes dict batches as keyword arguments (``model(**batch)``), shifts the
labels itself and returns a ``ModelOutput`` whose ``.loss`` ddpjob uses as the loss, so the data
of ``examples.lm`` fits it unchanged. Its output head is tied to the token embedding.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def config(vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 2, block: int = 128) -> Any:
    """The GPT2Config of tiny_gpt2, also what transformers needs to load exported weights."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab,
        n_embd=dim,
        n_layer=layers,
        n_head=heads,
        n_positions=block,
        bos_token_id=None,  # GPT-2's 50256 is outside a byte vocabulary
        eos_token_id=None,
    )


def tiny_gpt2(vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 2, block: int = 128) -> nn.Module:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(config(vocab, dim, layers, heads, block))
    model.loss_type = "ForCausalLM"  # the loss transformers picks anyway; named, it does not warn
    return model
