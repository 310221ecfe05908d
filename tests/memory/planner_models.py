"""Models the planner is measured on (tests/memory and bench/planner.py): each has blocks, so
activation checkpointing applies, and builds from nothing but torch (Llama: transformers)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class MlpBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def mlp(width: int = 256, depth: int = 6) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.Sequential(*[MlpBlock(width) for _ in range(depth)]),
                         nn.Linear(width, 10))


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(torch.relu(self.bn(self.conv1(x))))


def cnn(channels: int = 32, depth: int = 4) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.Sequential(*[ConvBlock(channels) for _ in range(depth)]),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 1000, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True) for _ in range(depth))
        self.out = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def llama() -> nn.Module:
    """A 4-layer Llama from a config (no download); ImportError without transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         attn_implementation="eager", use_cache=False)
    return LlamaForCausalLM(config)


#: name -> (factory, example batch factory)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor]]] = {
    "mlp": (mlp, lambda batch: torch.randn(batch, 64)),
    "cnn": (cnn, lambda batch: torch.randn(batch, 3, 32, 32)),
    "transformer": (Transformer, lambda batch: torch.randint(0, 1000, (batch, 64))),
    "llama": (llama, lambda batch: torch.randint(0, 1000, (batch, 64))),
}
#: a batch size per model that makes activations matter
BATCHES = {"mlp": 512, "cnn": 16, "transformer": 16, "llama": 8}


def transformer_48() -> tuple[nn.Module, torch.Tensor]:
    """The planner's speed case (``bench/planner.py --speed``): 48 identical encoder layers, 151 M
    parameters, a batch of 8 sequences of 256 tokens; ``gpukit plan`` takes the pair."""
    torch.manual_seed(0)
    return Transformer(width=512, depth=48), torch.randint(0, 1000, (8, 256))
