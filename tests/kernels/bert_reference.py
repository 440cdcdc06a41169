"""A plain-torch BERT layer to check ``DeepSpeedTransformerLayer`` against (the idea of DeepSpeed's
``tests/unit/modeling.py``/``modelingpreln.py``, our own code): separate q/k/v ``nn.Linear``s,
``nn.LayerNorm``s and an explicit softmax attention, in the Pre-LN or Post-LN order."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ReferenceBertLayer(nn.Module):
    """One BERT layer; ``pre_ln`` picks the order, ``gelu`` the GeLU ("tanh" as DeepSpeed's kernel)."""

    def __init__(self, hidden: int, inter: int, heads: int, pre_ln: bool, eps: float = 1e-12, gelu: str = "tanh"):
        super().__init__()
        self.heads, self.pre_ln, self.gelu = heads, pre_ln, gelu
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)   # DeepSpeed's attn_nw/attn_nb
        self.intermediate = nn.Linear(hidden, inter)
        self.output = nn.Linear(inter, hidden)
        self.norm = nn.LayerNorm(hidden, eps=eps)        # DeepSpeed's norm_w/norm_b

    @classmethod
    def copy_of(cls, ds_layer: nn.Module) -> ReferenceBertLayer:
        """A reference holding copies of ``ds_layer``'s parameters (its own gradients)."""
        cfg = ds_layer.config
        ref = cls(cfg.hidden_size, cfg.intermediate_size, cfg.heads, cfg.pre_layer_norm, cfg.layer_norm_eps)
        h = cfg.hidden_size
        with torch.no_grad():
            for i, lin in enumerate((ref.query, ref.key, ref.value)):
                lin.weight.copy_(ds_layer.attn_qkvw[i * h:(i + 1) * h])
                lin.bias.copy_(ds_layer.attn_qkvb[i * h:(i + 1) * h])
            for mod, w, b in ((ref.attn_out, "attn_ow", "attn_ob"), (ref.attn_norm, "attn_nw", "attn_nb"),
                              (ref.intermediate, "inter_w", "inter_b"), (ref.output, "output_w", "output_b"),
                              (ref.norm, "norm_w", "norm_b")):
                mod.weight.copy_(getattr(ds_layer, w))
                mod.bias.copy_(getattr(ds_layer, b))
        return ref.to(ds_layer.attn_qkvw.dtype)

    def grads_as_ds(self) -> dict[str, torch.Tensor]:
        """The gradients under DeepSpeedTransformerLayer's parameter names."""
        return {"attn_qkvw": torch.cat([m.weight.grad for m in (self.query, self.key, self.value)]),
                "attn_qkvb": torch.cat([m.bias.grad for m in (self.query, self.key, self.value)]),
                "attn_ow": self.attn_out.weight.grad, "attn_ob": self.attn_out.bias.grad,
                "attn_nw": self.attn_norm.weight.grad, "attn_nb": self.attn_norm.bias.grad,
                "inter_w": self.intermediate.weight.grad, "inter_b": self.intermediate.bias.grad,
                "output_w": self.output.weight.grad, "output_b": self.output.bias.grad,
                "norm_w": self.norm.weight.grad, "norm_b": self.norm.bias.grad}

    def attention(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        if mask is not None:
            scores = scores + mask
        ctx = torch.softmax(scores, dim=-1) @ v
        return self.attn_out(ctx.transpose(1, 2).reshape(b, s, h))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(F.gelu(self.intermediate(x), approximate=self.gelu))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre_ln:
            h = x + self.attention(self.norm(x), mask)
            return h + self.feed_forward(self.attn_norm(h))
        h = self.attn_norm(x + self.attention(x, mask))
        return self.norm(h + self.feed_forward(h))
