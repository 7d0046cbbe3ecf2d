"""The hand-written residual block that the tracer mechanism tests stack into toy models."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def two_blocks() -> nn.ModuleList:
    """Two sequential targets: the smallest stack that has a boundary between subgraphs."""
    return nn.ModuleList([Block(), Block()])
