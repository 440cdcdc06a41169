"""A small GPT-like block with dropout, and a stack of them that checkpoints each block through a
function given to it (none, ``checkpoint``, ``non_reentrant_checkpoint``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2, p: float = 0.2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d))) * scale
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Stack(nn.Module):
    """Embedding -> blocks -> head tied to the embedding (a tied weight across the checkpoints)."""

    def __init__(self, layers: int = 3, d: int = 16, vocab: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.wrap: Callable[..., Any] | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = self.wrap(block, x, None, 1.0) if self.wrap is not None else block(x, None, 1.0)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())


def tokens(seed: int = 0, batch: int = 2, t: int = 6, vocab: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, t), generator=torch.Generator().manual_seed(seed))
