"""A tiny causal LM whose sequence-parallel loss paths are compared with the whole sequence's
gradient, under dslaunch's engine (``test_gradients.py``) and under real DeepSpeed
(``scripts/deepspeed_sp_gradients.py``): it needs only torch and the package named by
``ds`` (``"dslaunch"`` or ``"deepspeed"``), so both interpreters import it.

Loss paths (``LOSSES``): ``alst`` DeepSpeed's ALST tutorial loss (each shard's mean gathered with
``torch.distributed.nn.functional.all_gather``), ``spl`` dslaunch's ``sequence_parallel_loss``,
``fpdt`` FPDT's layout, ``FPDT_Attention`` (dslaunch only: DeepSpeed's needs flash-attn) and
``FPDT_LogitsLoss`` reduced as Megatron-DeepSpeed does, ``fpdt_loss`` Ulysses attention with
``FPDT_LogitsLoss`` (runs under both), ``vspce`` DeepSpeed-Ulysses' Megatron loss
``vocab_sequence_parallel_cross_entropy`` (gathered per-token losses) and ``vpce`` its
``vocab_parallel_cross_entropy(reduction="mean", sp_group=...)``.
"""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, LENGTH, MICRO, CHUNK = 24, 16, 4, 32, 2, 8
LOSSES = ("alst", "spl", "fpdt", "fpdt_loss", "vspce", "vpce")


def sample(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` ``[MICRO, LENGTH]`` of a replica's step; labels are the next token,
    -100 for a 3-token prompt."""
    g = torch.Generator().manual_seed(100 * step + replica)
    ids = torch.randint(0, VOCAB, (MICRO, LENGTH + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[:, :3] = -100
    return ids[:, :-1], labels


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    """Causal attention over ``[b, s, heads, d]``."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


class Attention(torch.nn.Module):
    """QKV projection, causal attention (whole, Ulysses or FPDT's chunked), output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_w = torch.nn.Parameter(torch.randn(3 * HIDDEN, HIDDEN) / HIDDEN ** 0.5)
        self.qkv_b = torch.nn.Parameter(torch.randn(3 * HIDDEN) / 10)
        self.o_w = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN) / HIDDEN ** 0.5)
        self.o_b = torch.nn.Parameter(torch.randn(HIDDEN) / 10)
        self.ulysses: Any = None
        self.fpdt: Any = None  # (the package's FPDT_Attention class, the group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s, hidden]`` batch-first, or ``[s, b, hidden]`` with FPDT."""
        if self.fpdt is not None:
            cls, group = self.fpdt
            config = SimpleNamespace(kv_channels=HIDDEN // HEADS, num_attention_heads=HEADS,
                                     num_key_value_heads=HEADS, hidden_size=HIDDEN, attention_dropout=0.0)
            layer = cls(config, self.qkv_w, self.qkv_b, self.o_w, self.o_b, group, return_bias=False,
                        chunk_size=CHUNK)
            return layer(x, None, None, None, cpu_offloading=True)[0]
        b, s, _ = x.shape
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).view(b, s, 3, HEADS, HIDDEN // HEADS).unbind(2)
        a = _causal(q, k, v) if self.ulysses is None else self.ulysses(q, k, v, batch_dim_idx=0)
        return F.linear(a.reshape(b, s, HIDDEN), self.o_w, self.o_b)


class Head(torch.nn.Module):
    """The LM head and the loss of one path (its own module: ZeRO-3 gathers its weight for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN) / HIDDEN ** 0.5)

    def forward(self, h: torch.Tensor, labels: Any, how: str, ds: str, group: Any) -> torch.Tensor:
        """The whole sequence's mean loss over counted labels (``h`` batch-first, or ``[l, b, hidden]``
        for the FPDT paths with ``labels`` then ``(labels [b, l], loss_mask [b, S])``)."""
        if how in ("fpdt", "fpdt_loss"):
            from_package = importlib.import_module(f"{ds}.sequence.fpdt_layer").FPDT_LogitsLoss
            labels, mask = labels
            rank, size = dist.get_rank(group), dist.get_world_size(group)
            losses = from_package.apply(h, labels, self.weight, rank, size, group, 2)  # [S, b]
            return (losses * mask.t()).sum() / mask.sum()
        logits = F.linear(h, self.weight)
        if how == "whole":
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if how in ("vspce", "vpce"):
            from_package = importlib.import_module(f"{ds}.sequence.cross_entropy")
            if how == "vpce":
                return from_package.vocab_parallel_cross_entropy(logits, labels, sp_group=group, reduction="mean")
            per_token = from_package.vocab_sequence_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                                           labels.t().contiguous(), group)
            every = torch.cat([torch.empty_like(labels.t()) for _ in range(dist.get_world_size(group))])
            dist.all_gather_into_tensor(every, labels.t().contiguous(), group=group)
            counted = (every != -100).float()
            return (per_token * counted).sum() / counted.sum()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        counted = (labels != -100).sum()
        if how == "spl":
            from dslaunch.runtime.sequence_parallel.loss import sequence_parallel_loss

            return sequence_parallel_loss(loss, counted, group)
        # ALST tutorial: gather each shard's mean and its counted tokens, weigh, divide
        from torch.distributed.nn.functional import all_gather

        losses = all_gather(loss, group=group)
        tokens = all_gather(counted, group=group)
        total = sum(part * n for part, n in zip(losses, tokens, strict=True))
        return total / max(sum(tokens), 1)


class TinyLM(torch.nn.Module):
    """Embeddings, one attention block, a layer norm and the head. ``how`` is ``"whole"`` (one
    process, the whole sequence) or a loss path of ``LOSSES``; ``connect(ds, group)`` wires the
    sequence group once the engine made it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.ds, self.group = how, None, None
        self.tok, self.pos = torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Embedding(LENGTH, HIDDEN)
        self.attn, self.norm, self.head = Attention(), torch.nn.LayerNorm(HIDDEN), Head()

    def connect(self, ds: str, group: Any) -> None:
        self.ds, self.group = ds, group
        if self.how == "fpdt":
            self.attn.fpdt = (importlib.import_module(f"{ds}.sequence.fpdt_layer").FPDT_Attention, group)
        elif self.how != "whole":
            layer = importlib.import_module(f"{ds}.sequence.layer")
            self.attn.ulysses = layer.DistributedAttention(_causal, group, scatter_idx=2, gather_idx=1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: Any) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos(position_ids)
        if self.how == "fpdt":
            x = x.transpose(0, 1)  # Megatron's [s, b, hidden]
        x = x + self.attn(x)
        if self.how == "fpdt_loss":
            x = x.transpose(0, 1)
        return self.head(self.norm(x), labels, self.how, self.ds, self.group)


def shard(ids: torch.Tensor, labels: torch.Tensor, how: str, rank: int, size: int) -> dict[str, Any]:
    """The forward's keywords for sequence rank ``rank`` of ``size``: contiguous shards, or FPDT's
    load-balanced order (``fpdt``, ``fpdt_loss``: chunks of ``CHUNK // size`` tokens dealt round robin)."""
    positions = torch.arange(LENGTH).expand(MICRO, LENGTH)
    if how == "whole":
        return {"input_ids": ids, "position_ids": positions, "labels": labels}
    piece = CHUNK // size if how == "fpdt" else LENGTH // size
    # every rank's positions, in rank order (FPDT: chunks of `piece` tokens dealt round robin)
    order = torch.arange(LENGTH).view(-1, size, piece).transpose(0, 1).reshape(size, -1)
    mine = order[rank]
    local = {"input_ids": ids[:, mine], "position_ids": positions[:, mine], "labels": labels[:, mine]}
    if how in ("fpdt", "fpdt_loss"):  # FPDT_LogitsLoss's labels and the whole sequence's loss mask
        local["labels"] = (labels[:, mine].clamp(min=0), (labels != -100).float()[:, order.reshape(-1)])
    return local


def train_steps(engine: Any, how: str, replica: int, sp_rank: int, sp: int, steps: int,
          full_grad: Any) -> tuple[list[float], list[list[float]]]:
    """``steps`` steps of ``engine`` (dslaunch's or DeepSpeed's) on this rank's shard of each step's
    sample: the losses and, after each backward, every parameter's averaged gradient flattened
    (``full_grad``: that library's ``safe_get_full_grad``; lists, so that they cross processes)."""
    losses, grads = [], []
    for step in range(steps):
        loss = engine(**shard(*sample(step, replica), how, sp_rank, sp))
        engine.backward(loss)
        grads.append(torch.cat([full_grad(p).reshape(-1) for p in engine.module.parameters()]).tolist())
        engine.step()
        losses.append(float(loss))
    return losses, grads


def ratio(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(scale, residual)``: the least-squares factor of ``got`` on ``want`` and the largest
    difference left after it, over the largest value of ``want``."""
    scale = float(got @ want / (want @ want))
    return scale, float((got - scale * want).abs().max() / want.abs().max())


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4)
