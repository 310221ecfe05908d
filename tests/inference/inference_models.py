"""Tiny Hugging Face models for the inference tests (no download)."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def tiny_llama(tied: bool = True, layers: int = 4, hidden: int = 64, vocab: int = 256) -> Any:
    transformers = pytest.importorskip("transformers", reason="transformers (in the test extra) is not installed")
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()
