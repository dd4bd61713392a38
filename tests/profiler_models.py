"""Tiny models whose FLOPs have an exact closed form, for the profiler tests.

Only matmul-class ops (mm, bmm, attention) carry FLOPs in ``torch.utils.flop_counter``;
these models use nothing else that counts, so the expected numbers are written down here
from the shapes alone.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def linear_only(dims: tuple[int, ...] = (8, 16, 12, 4)) -> nn.Sequential:
    """Linear(dims[0], dims[1]) -> ... without bias or activation: every FLOP is a matmul."""
    return nn.Sequential(*(nn.Linear(a, b, bias=False) for a, b in pairwise(dims)))


def linear_only_flops(dims: tuple[int, ...], rows: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of ``linear_only(dims)`` on ``rows`` input rows whose input
    does not require grad: forward one mm per layer (2 * rows * in * out); backward the
    weight-grad mm per layer plus the input-grad mm for every layer but the first."""
    per_layer = [2 * rows * a * b for a, b in pairwise(dims)]
    return sum(per_layer), sum(per_layer) + sum(per_layer[1:])


class Attention(nn.Module):
    """(B, H, S, D) q, k, v -> scaled_dot_product_attention; no parameters."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


class LinearBlock(nn.Module):
    """x -> W2 relu(W1 x), no bias: 4 * rows * dim * hidden forward FLOPs."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, dim) -> (B, dim)
        return self.fc2(torch.relu(self.fc1(x)))


class CheckpointStack(nn.Module):
    """Linear(in_dim, dim) -> num_blocks x LinearBlock -> Linear(dim, out), no bias; with
    ``checkpointed`` every block runs under non-reentrant activation checkpointing."""

    def __init__(self, checkpointed: bool, dim: int = 16, hidden: int = 24, num_blocks: int = 3,
                 in_dim: int = 7, out: int = 5) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.input = nn.Linear(in_dim, dim, bias=False)
        self.blocks = nn.ModuleList(LinearBlock(dim, hidden) for _ in range(num_blocks))
        self.head = nn.Linear(dim, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_dim) -> (B, out)
        h = self.input(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return self.head(h)


def checkpoint_stack_flops(rows: int, dim: int = 16, hidden: int = 24, num_blocks: int = 3,
                           in_dim: int = 7, out: int = 5) -> tuple[int, int, int]:
    """(forward, backward, recompute) FLOPs of CheckpointStack on ``rows`` rows whose input
    does not require grad (recompute counts only when ``checkpointed``)."""
    block = 2 * rows * dim * hidden * 2
    first, head = 2 * rows * in_dim * dim, 2 * rows * dim * out
    fwd = first + num_blocks * block + head
    bwd = first + 2 * num_blocks * block + 2 * head  # no input grad for the first layer
    return fwd, bwd, num_blocks * block
