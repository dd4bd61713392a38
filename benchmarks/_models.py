"""The models and data of ``benchmarks/compare.py``: a GPT-style stack and a stack of MLP
blocks, built from a seed so every system starts from the same weights and sees the same
batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "gpt" or "mlp"
    hidden: int
    layers: int
    heads: int
    vocab: int
    seq: int
    batch: int  # per rank


def gpt_spec(tiny: bool = False, **overrides: int | None) -> ModelSpec:
    # default: 10 blocks of width 768 (7.09 M each) + 8192-token embedding and LM head
    # = 83.8 M parameters; tiny: 0.32 M
    base = dict(hidden=96, layers=2, heads=4, vocab=512, seq=32, batch=2) if tiny else dict(
        hidden=768, layers=10, heads=12, vocab=8192, seq=64, batch=2)
    base.update({k: v for k, v in overrides.items() if v is not None})
    return ModelSpec(kind="gpt", **base)


def mlp_spec(tiny: bool = False, **overrides: int | None) -> ModelSpec:
    # issue 6's measured baseline: 8 blocks of width 512 (16.8 M), batch 4 x 64 per rank
    base = dict(hidden=64, layers=2, heads=1, vocab=0, seq=16, batch=2) if tiny else dict(
        hidden=512, layers=8, heads=1, vocab=0, seq=64, batch=4)
    base.update({k: v for k, v in overrides.items() if v is not None and k != "vocab"})
    return ModelSpec(kind="mlp", **base)


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"--hidden {hidden} is not divisible by --heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, H, T, C/H)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tok_emb = nn.Embedding(spec.vocab, spec.hidden)
        self.pos_emb = nn.Embedding(spec.seq, spec.hidden)
        self.blocks = nn.ModuleList(Block(spec.hidden, spec.heads) for _ in range(spec.layers))
        self.ln_f = nn.LayerNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)  # untied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # idx (B, T) token ids -> logits (B, T, V)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class MLPBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class MLPStack(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.blocks = nn.Sequential(*(MLPBlock(spec.hidden) for _ in range(spec.layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def build_model(spec: ModelSpec, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(spec) if spec.kind == "gpt" else MLPStack(spec)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks)


def make_batches(spec: ModelSpec, seed: int, rank: int, count: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (input, target) pairs for ``rank``: the same on every run and system."""
    out = []
    for step in range(count):
        g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
        if spec.kind == "gpt":
            tokens = torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), generator=g)
            out.append((tokens[:, :-1], tokens[:, 1:]))  # (B, T) ids, next-token targets
        else:
            shape = (spec.batch, spec.seq, spec.hidden)
            out.append((torch.randn(shape, generator=g), torch.randn(shape, generator=g)))
    return out


def loss_fn(spec: ModelSpec, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if spec.kind == "gpt":
        return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))
    return F.mse_loss(out.float(), target)
