"""DeepSpeed's ``deepspeed.runtime.chunked_cross_entropy``: a causal-LM loss that never holds an fp32
copy of the whole ``[tokens, vocab]`` logits.

Hugging Face's ``ForCausalLMLoss`` casts the logits to fp32 and calls ``cross_entropy``, which keeps
an fp32 log-softmax for backward; backward then makes two more fp32 ``[tokens, vocab]`` tensors.
With a 150k vocabulary at 8k tokens each is ~5 GB, all alive where training memory peaks. This loss
is the same fp32 arithmetic keeping only the logits as given and one fp32 log-sum-exp per token;
backward rebuilds the softmax and writes the gradient in the logits' dtype (the dtype the eager
path casts to anyway). The computation is the ``"cross_entropy"`` kernel op (``dslaunch.kernels``):
a Triton kernel on CUDA, the torch reference (blocks of rows) anywhere.

``backend``: ``"auto"`` (the dispatch point's choice), ``"torch"`` (the reference), ``"triton"``
(the kernel, or ``RuntimeError`` where it cannot run), as DeepSpeed's names.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from dslaunch.errors import UsageError
from dslaunch.kernels import dispatch
from dslaunch.runtime.tensor_parallel.loss import causal_lm_mean, shifted_labels

__all__ = ["BACKENDS", "chunked_cross_entropy", "ChunkedCausalLMLoss", "install_chunked_causal_lm_loss",
           "triton_backend_available"]

BACKENDS = ("auto", "torch", "triton")
_MODE = {"torch": "reference", "triton": "fused"}  # the dispatch mode a named backend asks for


def triton_backend_available() -> bool:
    """Whether the Triton kernel can run here (triton imports and a CUDA device exists)."""
    from dslaunch.kernels.triton import available

    return available()


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


def _block_rows(block_rows: int | None) -> int | None:
    if block_rows is None:
        return None
    try:
        rows = operator.index(block_rows)
    except TypeError:
        raise TypeError(f"block_rows: expected a positive integer or None, got {block_rows!r}") from None
    if rows <= 0:
        raise ValueError(f"block_rows: expected a positive integer or None, got {rows}")
    return rows


def _op(backend: str, device: torch.device) -> Any:
    if backend == "auto":
        return dispatch.get("cross_entropy", device)
    try:
        return dispatch.KERNELS.get("cross_entropy", device, _MODE[backend])
    except UsageError:
        raise RuntimeError(f"backend='triton': the Triton cross-entropy needs CUDA logits and triton (the logits "
                           f"are on {device.type}); use backend='torch' or 'auto'") from None


def chunked_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                          reduction: str = "mean", block_rows: int | None = None,
                          backend: str = "auto") -> torch.Tensor:
    """``F.cross_entropy(logits.float(), target, ignore_index=..., reduction=...)`` of ``[rows, vocab]``
    logits and ``[rows]`` long targets, without fp32 ``[rows, vocab]`` tensors. ``"mean"`` divides
    by the counted rows (NaN when none counts, as torch's). ``block_rows`` sizes the torch
    reference's blocks (default: ~256 MiB of fp32 each).

    Raises:
        ValueError, TypeError: bad shapes, reduction, backend or ``block_rows``.
        RuntimeError: targets that are not long; a target outside the vocabulary (from the device,
            as ``cross_entropy``'s); ``backend="triton"`` where it cannot run.
    """
    rows = _block_rows(block_rows)
    _check_backend(backend)
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"expected [rows, vocab] logits and [rows] targets, got {tuple(logits.shape)} and "
                         f"{tuple(target.shape)}")
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction: expected 'none', 'sum' or 'mean', got {reduction!r}")
    if target.dtype != torch.long:
        raise RuntimeError(f"expected torch.long class indices as targets, got {target.dtype}")
    target = target.to(logits.device).contiguous()
    outside = (target != ignore_index) & ((target < 0) | (target >= logits.shape[-1]))
    # on the device, without a host synchronization every step
    torch._assert_async(~outside.any(), f"target out of range for a vocabulary of {logits.shape[-1]}")
    loss = _op(backend, logits.device)(logits.contiguous(), target, ignore_index, rows)
    if reduction == "none":
        return loss
    total = loss.sum()
    return total if reduction == "sum" else total / (target != ignore_index).sum()


class ChunkedCausalLMLoss:
    """Hugging Face's ``ForCausalLMLoss`` (labels shifted by one, ``ignore_index``, the sum over
    ``num_items_in_batch`` when the Trainer passes it) on ``chunked_cross_entropy``."""

    def __init__(self, block_rows: int | None = None, backend: str = "auto"):
        _check_backend(backend)
        self.block_rows, self.backend = _block_rows(block_rows), backend

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch: Any = None,
                 ignore_index: int = -100, shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        targets = shifted_labels(labels, shift_labels, ignore_index).reshape(-1)
        total = chunked_cross_entropy(logits.reshape(-1, vocab_size), targets, ignore_index, "sum", self.block_rows,
                                      self.backend)
        return causal_lm_mean(total, targets.to(total.device), ignore_index, num_items_in_batch)


def install_chunked_causal_lm_loss(model: Any, block_rows: int | None = None,
                                   backend: str = "auto") -> ChunkedCausalLMLoss:
    """Make a Hugging Face causal LM train with ``ChunkedCausalLMLoss``.

    Raises:
        ValueError: the model's ``loss_function`` is not transformers' ``ForCausalLMLoss`` (another
            loss would change the objective), or cannot be replaced.
    """
    from transformers.loss.loss_utils import ForCausalLMLoss

    current = getattr(model, "loss_function", None)
    if current is not ForCausalLMLoss:
        raise ValueError(f"install_chunked_causal_lm_loss replaces transformers' ForCausalLMLoss only; this model's "
                         f"loss_function is {current!r}")
    loss = ChunkedCausalLMLoss(block_rows, backend)
    try:
        model.loss_function = loss
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"{type(model).__name__}.loss_function cannot be replaced ({exc})") from None
    if model.loss_function is not loss:
        raise ValueError(f"{type(model).__name__}.loss_function ignores assignment")
    return loss
