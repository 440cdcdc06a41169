"""A tiny pre-norm transformer in plain torch (no transformers), shaped like Hugging Face's:
``config`` with head counts, ``forward(input_ids)``, separate q/k/v and a gated MLP."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.num_heads, self.num_kv_heads = heads, kv_heads
        self.q = nn.Linear(hidden, heads * self.head_dim)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim)
        self.o = nn.Linear(heads * self.head_dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        repeat = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, inner: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.RMSNorm(hidden)
        self.attn = Attention(hidden, heads, kv_heads)
        self.gate, self.up, self.down = nn.Linear(hidden, inner), nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 37, hidden: int = 48, heads: int = 6, kv_heads: int = 3, inner: int = 80,
                 layers: int = 2):
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=hidden,
                                      vocab_size=vocab)
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, kv_heads, inner) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tiny_lm(**kwargs: int) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(**kwargs).eval()


class GeluMLP(nn.Module):
    """Linear -> GeLU (tanh) -> Linear, and a LayerNorm: what kernel injection fuses."""

    def __init__(self, hidden: int = 16, inner: int = 40):
        super().__init__()
        self.config = SimpleNamespace()
        self.embed = nn.Embedding(11, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc, self.act, self.proj = nn.Linear(hidden, inner), nn.GELU(approximate="tanh"), nn.Linear(inner, hidden)
        self.other = nn.SiLU()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        return self.other(self.proj(self.act(self.fc(self.norm(x)))))
