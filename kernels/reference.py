"""The reference (torch) implementation of every op ``dispatch.KERNELS`` names: what runs where no
fused kernel does, and what the fused kernels are tested against.

dslaunch's own optimizers' updates (``adam_update`` for ``runtime.optim.adam.Adam``, ``lion_update``
for ``runtime.optim.lion.Lion``, over cache-sized batches: ``chunks``), torch's own optimizer
steps, the flat Adagrad and CPU Adam updates of DeepSpeed's CPU optimizers, the 1-bit packing of
``runtime.optim.compression`` (``pack_reference``/``unpack_reference``), and the norms and bias +
GeLU of ``kernels/normalization.py``/``kernels/bias_gelu.py`` (torch's functional ops), and the
row-blocked cross-entropy of ``runtime.chunked_cross_entropy`` (``cross_entropy_rows``).
They live here, not next to their callers in ``runtime``, so ``kernels`` imports nothing above it.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch

from dslaunch.kernels.chunks import CHUNK_NUMEL, chunked, unscaled

__all__ = ["adam_update", "lion_update", "torch_step", "adagrad_update", "cpu_adam_update", "layer_norm",
           "rms_norm", "bias_gelu", "check_bias_gelu", "packbits", "unpackbits", "pack_reference",
           "unpack_reference", "SCALE_BYTES", "cross_entropy_rows", "cross_entropy_block_rows"]

SCALE_BYTES = 4  # 1-bit rows: an fp32 scale travels as 4 bytes behind its chunk of signs


def adam_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, betas: tuple[float, float],
                eps: float, weight_decay: float, bias_correction: bool, adam_w_mode: bool,
                inv_scale: float | None, chunk_numel: int = CHUNK_NUMEL) -> None:
    """The reference ``"adam"`` kernel: one step of params sharing the step count ``step``, in place."""
    wd = weight_decay
    beta1, beta2 = betas
    bc1, bc2 = (1.0 - beta1**step, 1.0 - beta2**step) if bias_correction else (1.0, 1.0)
    for ps, gs, ms, vs in chunked((params, grads, exp_avgs, exp_avg_sqs), chunk_numel):
        gs = unscaled(gs, inv_scale)
        if wd != 0.0 and not adam_w_mode:
            gs = torch._foreach_add(gs, ps, alpha=wd)
        torch._foreach_lerp_(ms, gs, 1.0 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, gs, gs, value=1.0 - beta2)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, eps)
        if wd != 0.0 and adam_w_mode:
            torch._foreach_mul_(ps, 1.0 - lr * wd)
        torch._foreach_addcdiv_(ps, ms, denom, value=-lr / bc1)


def lion_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], *,
                lr: float, betas: tuple[float, float], weight_decay: float, inv_scale: float | None,
                chunk_numel: int = CHUNK_NUMEL) -> None:
    """The reference ``"lion"`` kernel: one Lion step, in place."""
    beta1, beta2 = betas
    for ps, gs, ms in chunked((params, grads, exp_avgs), chunk_numel):
        gs = unscaled(gs, inv_scale)
        if weight_decay != 0.0:
            torch._foreach_mul_(ps, 1.0 - lr * weight_decay)
        update = torch._foreach_lerp(ms, gs, 1.0 - beta1)
        torch._foreach_sign_(update)
        torch._foreach_add_(ps, update, alpha=-lr)
        torch._foreach_lerp_(ms, gs, 1.0 - beta2)


def torch_step(optimizer: Any, closure: Any = None) -> Any:
    """One step of ``optimizer`` as the ``torch.optim`` class it derives from computes it.

    The reference of the ``torch.*`` ops: ``optimizer`` is a subclass whose own ``step``
    dispatched here. torch wraps each class's ``step`` once, for its step hooks and the profiler;
    the subclass's step already ran them, so this calls the implementation under that wrapper.
    """
    base = next(c for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim"))
    step = inspect.unwrap(base.step, stop=lambda f: not getattr(f, "hooked", False))
    return step(optimizer, closure)


def adagrad_update(params: list[Any], grads: list[Any], state_sums: list[Any], *, clr: float, eps: float,
                   weight_decay: float, inv_scale: float | None) -> None:
    """The reference ``"adagrad"`` kernel: one Adagrad step at learning rate ``clr``, in place.

    DeepSpeed's CPU Adagrad and torch's Adagrad (whose ``lr_decay`` the caller folds into
    ``clr``): ``g += wd * p; sum += g^2; p -= clr * g / (sqrt(sum) + eps)``.
    """

    for p, g, s in zip(params, grads, state_sums, strict=True):
        g = g if inv_scale is None or inv_scale == 1.0 else g * inv_scale
        if weight_decay != 0.0:
            g = g.add(p, alpha=weight_decay)
        s.addcmul_(g, g)
        p.addcdiv_(g, torch.sqrt(s).add_(eps), value=-clr)


def cpu_adam_update(params: list[Any], grads: list[Any], exp_avgs: list[Any], exp_avg_sqs: list[Any], *,
                    step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                    bias_correction: bool, adam_w_mode: bool, inv_scale: float | None,
                    chunk_numel: int | None = None) -> None:
    """The reference ``"cpu_adam"`` kernel: ``"adam"`` in DeepSpeed's ``DeepSpeedCPUAdam`` association.

    ``m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2; p += (-lr wd) p`` (AdamW mode);
    ``p += (-lr / bc1) (m / (sqrt(v) / sqrt(bc2) + eps))`` with the correction as a multiply, so
    one division per element. Same rounding steps as the C kernel except where it fuses a
    multiply-add (within an ulp).
    """

    beta1, beta2 = betas
    bc1, bc2 = (1.0 - beta1**step, 1.0 - beta2**step) if bias_correction else (1.0, 1.0)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        g = g if inv_scale is None or inv_scale == 1.0 else g * inv_scale
        if weight_decay != 0.0 and not adam_w_mode:
            g = g.add(p, alpha=weight_decay)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = torch.sqrt(v).mul_(1.0 / bc2**0.5).add_(eps)
        if weight_decay != 0.0 and adam_w_mode:
            p.add_(p, alpha=-lr * weight_decay)
        p.add_(m / denom, alpha=-lr / bc1)


def layer_norm(x: Any, weight: Any, bias: Any, eps: float = 1e-5, normalized_shape: Any = None) -> Any:
    """The reference ``"layer_norm"`` op: ``F.layer_norm`` over ``weight``'s shape (or ``normalized_shape``)."""
    import torch.nn.functional as F

    shape = tuple(weight.shape) if weight is not None else tuple(normalized_shape)
    return F.layer_norm(x, shape, weight, bias, eps)


def rms_norm(x: Any, weight: Any, eps: float = 1e-6, normalized_shape: Any = None) -> Any:
    """The reference ``"rms_norm"`` op: ``F.rms_norm`` over ``weight``'s shape (or ``normalized_shape``)."""
    import torch.nn.functional as F

    shape = tuple(weight.shape) if weight is not None else tuple(normalized_shape)
    return F.rms_norm(x, shape, weight, eps)


def check_bias_gelu(x: Any, bias: Any, approximate: str, p: float) -> None:
    """The argument checks both ``"bias_gelu"`` implementations share.

    Raises:
        ValueError: ``approximate`` not "none"/"tanh", ``p`` outside [0, 1), or a bias whose shape
            is not the input's trailing shape.
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', not {approximate!r}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), not {p}")
    if bias.dim() == 0 or tuple(x.shape[x.dim() - bias.dim():]) != tuple(bias.shape):
        raise ValueError(f"bias of shape {list(bias.shape)} does not match the input's trailing dims "
                         f"{list(x.shape)}")


def bias_gelu(x: Any, bias: Any, approximate: str = "none", p: float = 0.0, training: bool = True,
              seed: int | None = None) -> Any:
    """The reference ``"bias_gelu"`` op: ``dropout(gelu(x + bias, approximate), p)`` in torch ops.

    ``seed`` seeds a generator of the input's device for the mask (None: torch's default one).
    """
    import torch.nn.functional as F

    check_bias_gelu(x, bias, approximate, p)
    y = F.gelu(x + bias, approximate=approximate)
    if not training or p == 0.0:
        return y
    generator = None if seed is None else torch.Generator(device=x.device).manual_seed(seed)
    keep = torch.rand(y.shape, generator=generator, device=y.device) >= p
    return y * keep / (1.0 - p)


def packbits(nonneg: torch.Tensor) -> torch.Tensor:
    """Bools (``x >= 0``; numel a multiple of 8) -> uint8, first element in the high bit.

    Plain torch (8 shifted ORs over strided columns: ~2x faster here than a multiply-and-sum).
    """
    bits = nonneg.view(-1, 8).view(torch.uint8)
    packed = bits[:, 0] << 7
    for i in range(1, 8):
        packed |= bits[:, i] << (7 - i)
    return packed


@functools.cache
def _sign_table(device: torch.device) -> torch.Tensor:
    """Row b: the 8 signs (+1/-1, fp32) that byte b packs."""
    b = torch.arange(256, dtype=torch.int64).unsqueeze(1)
    bits = (b >> torch.arange(7, -1, -1)).bitwise_and_(1)
    return bits.float().mul_(2.0).sub_(1.0).to(device)


def unpackbits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 -> signs as fp32 +1/-1 (8 per byte, high bit first): one table lookup per byte."""
    signs = _sign_table(packed.device)[packed.reshape(-1).long()]
    return signs.view(*packed.shape[:-1], -1)


def pack_reference(x: torch.Tensor, error: torch.Tensor, rows: torch.Tensor, scale: float) -> None:
    """The ``"onebit_pack"`` op in torch: the signs of ``x`` (``x >= 0``) packed into ``rows``
    (uint8, (rows, signs + 4): row r holds the r-th piece of ``x``, ``scale`` as fp32 behind it);
    ``error`` = x - scale * sign(x)."""
    nonneg = x >= 0
    # error = x - scale * sign(x) = x + scale - 2 * scale * [x >= 0]
    torch.add(x, nonneg, alpha=-2.0 * scale, out=error).add_(scale)
    rows[:, :-SCALE_BYTES].copy_(packbits(nonneg).view(rows.shape[0], -1))
    rows[:, -SCALE_BYTES:].copy_(torch.tensor([scale], dtype=torch.float32).view(torch.uint8))


def unpack_reference(rows: torch.Tensor, out: torch.Tensor, mean: bool) -> None:
    """The ``"onebit_unpack"`` op in torch: ``out`` = each row's signs times its scale, row after
    row (``mean`` false), or the mean over the rows of that (``mean``: one row's worth)."""
    signs = unpackbits(rows[:, :-SCALE_BYTES])
    scales = rows[:, -SCALE_BYTES:].reshape(-1).clone().view(torch.float32).view(-1, 1)  # clone: aligned
    if mean:  # summed in row order (torch's sum(dim=0) has another order past 4 rows, per CPU)
        out.zero_()
        for row in signs.mul_(scales):
            out.add_(row)
        out.div_(rows.shape[0])
    else:
        out.view(rows.shape[0], -1).copy_(signs).mul_(scales)


# ---- "cross_entropy": per-row cross-entropy without an fp32 [rows, vocab] tensor kept --------------
# A block of rows is about this many fp32 elements (256 MiB), whatever the vocabulary.
_CE_BLOCK_ELEMENTS = 1 << 26


def cross_entropy_block_rows(vocab: int) -> int:
    """Rows per block for a vocabulary of ``vocab``: about ``_CE_BLOCK_ELEMENTS`` fp32 elements."""
    return max(1, _CE_BLOCK_ELEMENTS // max(1, vocab))


class _BlockedCrossEntropy(torch.autograd.Function):
    """Per-row loss of ``[rows, vocab]`` logits, one block of rows in fp32 at a time. Saves the
    logits as given and one fp32 log-sum-exp per row; backward rebuilds each block's softmax."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                block_rows: int) -> torch.Tensor:
        counted = target != ignore_index
        index = target.masked_fill(~counted, 0)  # an ignored row gathers column 0, then counts 0
        lse = logits.new_empty(logits.shape[0], dtype=torch.float32)
        picked = torch.empty_like(lse)
        for lo in range(0, logits.shape[0], block_rows):
            # the one fp32 block alive, changed in place: a copy even of fp32 logits (never the caller's)
            block = logits[lo:lo + block_rows].to(torch.float32, copy=True)
            picked[lo:lo + block_rows] = block.gather(-1, index[lo:lo + block_rows, None]).squeeze(-1)
            peak = block.amax(dim=-1, keepdim=True)
            lse[lo:lo + block_rows] = block.sub_(peak).exp_().sum(dim=-1).log_().add_(peak.squeeze(-1))
            del block  # before the next block is made, not after: one block alive, not two
        ctx.save_for_backward(logits, index, counted, lse)
        ctx.block_rows = block_rows
        return torch.where(counted, lse - picked, torch.zeros_like(lse))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if torch.is_grad_enabled():  # the gradient is computed outside autograd: no second derivative
            raise RuntimeError("the chunked cross-entropy has no second derivative (backward with create_graph)")
        logits, index, counted, lse = ctx.saved_tensors
        scale = torch.where(counted, grad.float(), torch.zeros_like(lse))
        out = torch.empty_like(logits)
        rows = ctx.block_rows
        for lo in range(0, logits.shape[0], rows):
            soft = logits[lo:lo + rows].to(torch.float32, copy=True).sub_(lse[lo:lo + rows, None]).exp_()
            soft.scatter_add_(-1, index[lo:lo + rows, None], soft.new_full((soft.shape[0], 1), -1.0))
            out[lo:lo + rows] = soft.mul_(scale[lo:lo + rows, None])
            del soft
        return out, None, None, None


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                       block_rows: int | None = None) -> torch.Tensor:
    """The reference ``"cross_entropy"`` op: ``F.cross_entropy(logits.float(), target,
    reduction="none")`` of contiguous ``[rows, vocab]`` logits and ``[rows]`` long targets (0 where
    ``ignore_index``), differentiable, its gradient in the logits' dtype."""
    rows = block_rows or cross_entropy_block_rows(logits.shape[-1])
    return _BlockedCrossEntropy.apply(logits, target, ignore_index, rows)
