"""A small GPT for the flops profiler's tests, and its analytic flops count."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, impl: str):
        super().__init__()
        self.heads, self.impl = heads, impl
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        if self.impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            if self.impl == "einsum":
                s = torch.einsum("bhqd,bhkd->bhqk", q, k)
            else:
                s = q @ k.transpose(-1, -2)
            p = (s / (d // self.heads) ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1)
            y = torch.einsum("bhqk,bhkd->bhqd", p, v) if self.impl == "einsum" else p @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, impl: str):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, impl)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, heads: int = 4, seq: int = 16,
                 impl: str = "sdpa", checkpoint: bool | str = False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, impl) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.checkpoint = checkpoint

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpoint == "reentrant")
            else:
                x = block(x)
        logits = self.head(self.ln(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def matmul_params(model: nn.Module) -> int:
    """N of 6N: the weights that multiply activations (every Linear's; not embeddings, biases, norms)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def analytic_step_flops(model: GPT, batch: int, seq: int) -> int:
    """6N + 12·L·H·Q·T per token, times the tokens: a training step's forward and backward."""
    layers, d = len(model.blocks), model.ln.normalized_shape[0]
    return batch * seq * (6 * matmul_params(model) + 12 * layers * d * seq)
