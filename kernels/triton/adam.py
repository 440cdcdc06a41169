"""The ``"adam"`` op in Triton: one launch updates every tensor of a list (multi-tensor Adam/AdamW).

Tensors are split into chunks of ``BLOCK`` elements; program ``i`` reads which tensor and which
offset chunk ``i`` covers from two small index tables, and that tensor's addresses from pointer
tables (int64 addresses cast to pointers), as apex's ``multi_tensor_apply`` does with CUDA
structs. Parameters, gradients and moments may each be fp32, bf16 or fp16 (one launch per
combination of dtypes): every element is computed in fp32 and stored back in its tensor's dtype. Math per element, step t
(as ``reference.adam_update``, the reference, and torch's AdamW)::

    g = g * inv_scale;  g += wd * p (L2 mode)
    m = m + (1 - beta1) * (g - m);  v = beta2 * v + (1 - beta2) * g * g
    p *= 1 - lr * wd (AdamW mode);  p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)

The tables live on the device, cached by content (``_on_device``): the chunk tables depend only on
the tensors' sizes, the pointer table only on their addresses, which repeat from step to step
(torch's caching allocator hands freed gradients' blocks back), so a step usually copies nothing.

Limitations: non-contiguous entries run the torch reference (``kernels.fused_adam.FusedAdam``
stages such tensors contiguously first); chunk offsets are int64, a tensor may hold more than
2**31 elements.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

__all__ = ["adam_op", "BLOCK"]

BLOCK = 1024


@triton.jit
def _adam_kernel(p_tab, g_tab, m_tab, v_tab, numel_tab, chunk_tensor, chunk_offset,
                 p_proto, g_proto, m_proto, v_proto,
                 lr, beta1, beta2, eps, weight_decay, step_size, inv_sqrt_bc2, inv_scale,
                 ADAM_W: tl.constexpr, DECAY: tl.constexpr, UNSCALE: tl.constexpr, BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    t = tl.load(chunk_tensor + chunk)
    offs = tl.load(chunk_offset + chunk) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numel_tab + t)
    # The *_proto arguments are tensors of each list's dtype: their pointer type types the casts.
    p_ptr = tl.load(p_tab + t).to(p_proto.dtype) + offs
    g_ptr = tl.load(g_tab + t).to(g_proto.dtype) + offs
    m_ptr = tl.load(m_tab + t).to(m_proto.dtype) + offs
    v_ptr = tl.load(v_tab + t).to(v_proto.dtype) + offs
    p = tl.load(p_ptr, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr, mask=mask, other=0.0).to(tl.float32)
    if UNSCALE:
        g = g * inv_scale
    if DECAY and not ADAM_W:
        g = g + weight_decay * p
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    if DECAY and ADAM_W:
        p = p * (1.0 - lr * weight_decay)
    p = p - step_size * (m / (tl.sqrt(v) * inv_sqrt_bc2 + eps))
    tl.store(p_ptr, p.to(p_proto.dtype.element_ty), mask=mask)
    tl.store(m_ptr, m.to(m_proto.dtype.element_ty), mask=mask)
    tl.store(v_ptr, v.to(v_proto.dtype.element_ty), mask=mask)


def adam_op(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
            exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, betas: tuple[float, float], eps: float,
            weight_decay: float, bias_correction: bool, adam_w_mode: bool, inv_scale: float | None,
            chunk_numel: int | None = None) -> None:
    """One Adam/AdamW step of tensors sharing the step count ``step``, in place.

    The ``"adam"`` op of ``dslaunch.kernels`` (signature there); ``chunk_numel`` is ignored. One
    launch per combination of dtypes (one, usually); entries with a non-contiguous tensor go to the
    reference (``reference.adam_update``), as the CPU kernels do.

    Raises:
        ValueError: lists of different lengths, or a tensor not shaped as its parameter.
    """
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    if len({len(x) for x in lists}) != 1 or any(x[i].numel() != p.numel() for x in lists for i, p in enumerate(params)):
        raise ValueError("adam_op: params, grads, exp_avgs and exp_avg_sqs must pair up tensors of one size")
    by_dtypes: dict[tuple[torch.dtype, ...], list[int]] = {}
    rest = []
    for i, p in enumerate(params):
        if p.numel() and all(x[i].is_contiguous() for x in lists):
            by_dtypes.setdefault(tuple(x[i].dtype for x in lists), []).append(i)
        elif p.numel():
            rest.append(i)
    hyper = {"step": step, "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
             "bias_correction": bias_correction, "adam_w_mode": adam_w_mode, "inv_scale": inv_scale}
    for index in by_dtypes.values():
        _launch([[x[i] for i in index] for x in lists], **hyper)
    if rest:
        from dslaunch.kernels.reference import adam_update

        adam_update(*([x[i] for i in rest] for x in lists), **hyper)


def _launch(lists: list[list[torch.Tensor]], *, step: int, lr: float, betas: tuple[float, float], eps: float,
            weight_decay: float, bias_correction: bool, adam_w_mode: bool, inv_scale: float | None) -> None:
    """One launch over contiguous, non-empty tensors with one dtype per list."""
    device = lists[0][0].device
    numels = tuple(p.numel() for p in lists[0])
    tables = _on_device(tuple(t.data_ptr() for x in lists for t in x) + numels, device).view(5, -1)
    chunks = _chunks(numels, device)
    beta1, beta2 = betas
    bc1, bc2 = (1.0 - beta1**step, 1.0 - beta2**step) if bias_correction else (1.0, 1.0)
    unscale = inv_scale is not None and inv_scale != 1.0
    _adam_kernel[(chunks.shape[1],)](
        tables[0], tables[1], tables[2], tables[3], tables[4], chunks[0], chunks[1], *(x[0] for x in lists),
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), float(lr / bc1),
        1.0 / math.sqrt(bc2), float(inv_scale) if unscale else 1.0,
        ADAM_W=bool(adam_w_mode), DECAY=weight_decay != 0.0, UNSCALE=unscale, BLOCK=BLOCK)


adam_op.handles_dtypes = True  # type: ignore[attr-defined]  # FusedAdam passes bf16/fp16 as they are


@functools.lru_cache(maxsize=8)
def _on_device(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, copied without waiting for the device."""
    table = torch.tensor(values, dtype=torch.int64)
    return table if device.type == "cpu" else table.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=8)
def _chunks(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Row 0: the tensor each ``BLOCK``-sized chunk belongs to; row 1: the chunk's offset in it."""
    counts = torch.tensor([-(-n // BLOCK) for n in numels], dtype=torch.int64)
    tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return _on_device(tuple(torch.stack([tensor, (torch.arange(len(tensor)) - first) * BLOCK]).view(-1).tolist()),
                      device).view(2, -1)
