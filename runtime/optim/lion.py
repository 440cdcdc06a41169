"""The Lion optimizer (sign momentum), which torch.optim lacks.

Semantics follow DeepSpeed's ``Lion`` (``optimizer.type: "Lion"``; Chen et al. 2023):

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

State per parameter: ``exp_avg`` (m). The update is the ``"lion"`` op of ``dslaunch.kernels``;
its reference (``kernels.reference.lion_update``) runs torch's ``_foreach`` kernels over cache-sized batches of the
parameters (``chunks``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dslaunch import kernels
from dslaunch.runtime.optim.chunks import ChunkedOptimizer

__all__ = ["Lion"]


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
