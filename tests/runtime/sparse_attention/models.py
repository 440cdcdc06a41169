"""A tiny BERT-shaped model (``model.bert.embeddings.position_embeddings``,
``model.bert.encoder.layer[i].attention.self.{query,key,value}``, ``model.config``): what
``SparseAttentionUtils`` reaches into, without the transformers package."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn


class SelfAttention(nn.Module):
    """Dense BERT self-attention: ``(hidden, extended_mask) -> context``."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, hidden = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.query, self.key, self.value))
        probs = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + mask, -1)
        return (probs @ v).transpose(1, 2).reshape(b, s, hidden)


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = SelfAttention(hidden, heads)
        self.norm = nn.LayerNorm(hidden)
        self.ff = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.norm(x + self.attention.self(x, mask))
        return x + self.ff(x)


class TinyBert(nn.Module):
    """Masked-token prediction over ``vocab`` tokens; ``forward(ids, attention_mask, labels) -> loss``."""

    def __init__(self, vocab: int = 32, hidden: int = 32, heads: int = 2, layers: int = 2, positions: int = 64):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=hidden, num_attention_heads=heads,
                                      max_position_embeddings=positions)
        self.bert = nn.Module()
        self.bert.embeddings = nn.Module()
        self.bert.embeddings.word_embeddings = nn.Embedding(vocab, hidden)
        self.bert.embeddings.position_embeddings = nn.Embedding(positions, hidden)
        self.bert.encoder = nn.Module()
        self.bert.encoder.layer = nn.ModuleList(Layer(hidden, heads) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        emb = self.bert.embeddings
        x = emb.word_embeddings(ids) + emb.position_embeddings(torch.arange(ids.shape[1]))
        extended = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0  # BERT's additive mask
        for layer in self.bert.encoder.layer:
            x = layer(x, extended)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(), ignore_index=-100)
