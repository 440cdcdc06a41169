"""The Lion optimizer (sign momentum), which torch.optim lacks.

Semantics follow DeepSpeed's ``Lion`` (``optimizer.type: "Lion"``; Chen et al. 2023):

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

State per parameter: ``exp_avg`` (m). The update is the ``"lion"`` op of ``dslaunch.kernels``;
its reference (``lion_update``) runs torch's ``_foreach`` kernels over cache-sized batches of the
parameters (``chunks``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dslaunch import kernels
from dslaunch.runtime.optim.chunks import CHUNK_NUMEL, ChunkedOptimizer, chunked, unscaled

__all__ = ["Lion", "lion_update"]


class Lion(ChunkedOptimizer):
    """Lion: update = lr * sign(interpolated momentum), decoupled weight decay.

    Args:
        params: parameters or param groups.
        lr: learning rate (default 1e-3; Lion usually wants 3-10x less than AdamW).
        betas: (beta1, beta2) for the update interpolation and the momentum EMA.
        weight_decay: decoupled weight decay.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    def _update_group(self, index: int, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        kernels.get("lion", params[0].device)(
            params, [p.grad for p in params], [self._state(p)["exp_avg"] for p in params],
            lr=float(group["lr"]), betas=group["betas"], weight_decay=float(group["weight_decay"]),
            inv_scale=self._inv_scale, chunk_numel=self.chunk_numel)


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
