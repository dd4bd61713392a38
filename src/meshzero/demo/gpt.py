"""A small byte-level GPT (nanoGPT's shape): token + position embeddings, pre-norm blocks of
causal self-attention and an MLP, a final LayerNorm and a head tied to the token embedding.

The repeated ``Block``s become meshzero's ZeRO units; the embeddings and the final norm stay
in the root unit (the tied embedding/head is one tensor, owned by the root).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 128  # context length in bytes
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, C / n_head)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def decode(self, x: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        """Generation: a prompt (B, T, C) into an empty ``cache``, or one new position
        (B, 1, C) attending to every cached key; ``cache`` becomes [k, v] of all positions."""
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        causal = not cache and T > 1
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def decode(self, x: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn.decode(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one tensor, counted once
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Parameters of the model, the tied embedding/head once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:  # (B, T) bytes -> (B, T, vocab) logits
        # position_ids (B, T): where idx sits in its sequence (a sequence-parallel shard)
        pos = torch.arange(idx.shape[1], device=idx.device) if position_ids is None \
            else position_ids
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` bytes to ``idx`` (B, T); temperature 0 is greedy.

        Keys and values are cached, so each new byte costs one position's forward; when the
        context is full, the cache restarts from the last half context."""
        caches: list[list[torch.Tensor]] = [[] for _ in self.blocks]
        pos = 0
        todo = idx[:, -self.cfg.block_size:]  # positions not in the cache yet
        for _ in range(max_new_tokens):
            if pos + todo.shape[1] > self.cfg.block_size:  # full: restart from half a context
                caches, pos = [[] for _ in self.blocks], 0
                todo = idx[:, -(self.cfg.block_size // 2):]
            logits = self._decode(todo, pos, caches)[:, -1, :]  # (B, vocab)
            pos += todo.shape[1]
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx, todo = torch.cat([idx, nxt], dim=1), nxt
        return idx

    def _decode(self, idx: torch.Tensor, start: int, caches: list[list[torch.Tensor]]
                ) -> torch.Tensor:
        """Logits (B, T, vocab) of ``idx`` (B, T) at positions start.. given the caches."""
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(start, start + T, device=idx.device))
        for block, cache in zip(self.blocks, caches, strict=True):
            assert isinstance(block, Block)  # the stack holds Blocks only
            x = block.decode(x, cache)
        return self.head(self.ln_f(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy; logits (B, T, vocab), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
