"""Small models for the split tests (CPU stages: ``"cpu"`` repeated)."""

from __future__ import annotations

import torch
from torch import nn


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(),
        nn.Linear(32, 5),
    )


class TinyTransformer(nn.Module):
    """Embedding, a ModuleList of blocks, a head: not an nn.Sequential (layers are named)."""

    def __init__(self, vocab: int = 17, dim: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True) for _ in range(depth)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
