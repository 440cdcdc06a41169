"""The inference tests' tiny GQA language model (``tests/inference/models.py``: plain torch, shaped
as Hugging Face's) with a loss: ``model(input_ids=..., labels=...)`` returns the next-token loss,
through a ``loss_function`` attribute as Hugging Face's models (the hook ``loss_parallel`` replaces)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.inference.models import TinyLM

VOCAB = 64


class TrainableLM(nn.Module):
    """8 query heads over 4 KV heads (or ``kv_heads``), width 32; ``tied``: GPT-2's tie of the output
    layer to the token embedding."""

    def __init__(self, kv_heads: int = 4, tied: bool = False):
        super().__init__()
        self.lm = TinyLM(vocab=VOCAB, hidden=32, heads=8, kv_heads=kv_heads, inner=64)
        nn.init.normal_(self.lm.embed.weight, std=0.02)  # as Hugging Face's: a tied head's logits stay small
        if tied:
            self.lm.head.weight = self.lm.embed.weight
        self.config = self.lm.config
        self.loss_function = next_token_loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm(input_ids)
        if labels is None:
            return logits
        return self.loss_function(logits=logits, labels=labels, vocab_size=VOCAB)


def rule_batch(step: int, batch: int = 8, seq: int = 12) -> torch.Tensor:
    """Step ``step``'s ``[batch, seq]`` token ids: random starts, then next = 5 * token + 3 mod
    vocab (a rule the model can learn); the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = [torch.randint(0, VOCAB, (batch,), generator=g)]
    for _ in range(seq - 1):
        ids.append((5 * ids[-1] + 3) % VOCAB)
    return torch.stack(ids, dim=1)


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs) -> torch.Tensor:
    """Each position predicts the next token (Hugging Face's ``ForCausalLMLoss`` without its options)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab_size), labels[:, 1:].reshape(-1))
