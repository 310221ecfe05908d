"""Tiny Hugging Face models for the inference tests (no download)."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def tiny_llama(tied: bool = True, layers: int = 4) -> Any:
    transformers = pytest.importorskip("transformers", reason="transformers (in the test extra) is not installed")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()
