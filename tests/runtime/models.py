"""Tiny deterministic models and data shared by the runtime tests."""

from __future__ import annotations

import torch


class TinyTransformer(torch.nn.Module):
    """One pre-norm transformer block over token embeddings, mean-pooled, then a linear head."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, classes: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.block = torch.nn.TransformerEncoderLayer(dim, heads, dim_feedforward=32, dropout=0.0,
                                                      batch_first=True, norm_first=True)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # the batches are built on CPU; the engine puts the model on the GPU where there is one
        tokens, labels = tokens.to(self.head.weight.device), labels.to(self.head.weight.device)
        h = self.block(self.embed(tokens)).mean(dim=1)
        return torch.nn.functional.cross_entropy(self.head(h).float(), labels)


def make_model(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer()


def batches(steps: int, global_batch: int, seq: int = 6, vocab: int = 32, classes: int = 4,
            seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches on every rank (a cycle of 4, so the loss can fall)."""
    g = torch.Generator().manual_seed(seed)
    pool = [(torch.randint(0, vocab, (global_batch, seq), generator=g),
             torch.randint(0, classes, (global_batch,), generator=g)) for _ in range(4)]
    return [pool[i % len(pool)] for i in range(steps)]
