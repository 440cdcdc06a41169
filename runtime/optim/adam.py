"""Adam with DeepSpeed FusedAdam's ``bias_correction`` switch, which torch's Adam lacks.

Used only for ``optimizer.params.bias_correction: false``; every other Adam/AdamW config is
served by torch's fused implementation (see ``registry.py``). Per parameter, step t:

    g = g + weight_decay * p                      (L2 mode, adam_w_mode false)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2
    denom = sqrt(v / bc2) + eps,  step_size = lr / bc1
      with bc1 = 1 - beta1^t, bc2 = 1 - beta2^t when bias_correction, else bc1 = bc2 = 1
    p = p * (1 - lr * weight_decay)               (decoupled mode, adam_w_mode true)
    p = p - step_size * m / denom

State per parameter: ``step`` (0-dim float tensor), ``exp_avg``, ``exp_avg_sq``, as torch's Adam,
so checkpoints and ZeRO shards look the same. The update is the ``"adam"`` op of
``dslaunch.kernels``; its reference (``kernels.reference.adam_update``) runs torch's ``_foreach`` kernels over
cache-sized batches (``chunks``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dslaunch import kernels
from dslaunch.runtime.optim.chunks import ChunkedOptimizer

__all__ = ["Adam"]


class Adam(ChunkedOptimizer):
    """Adam/AdamW with an optional bias correction (DeepSpeed FusedAdam semantics).

    Args:
        params: parameters or param groups.
        lr, betas, eps, weight_decay: as torch's Adam.
        bias_correction: divide the moments by (1 - beta^t).
        adam_w_mode: decoupled weight decay (AdamW) instead of L2 added to the gradient.
    """

    moment_keys = ("exp_avg", "exp_avg_sq")
    counts_steps = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, bias_correction: bool = True,
                 adam_w_mode: bool = True):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction, "adam_w_mode": adam_w_mode}
        super().__init__(params, defaults)

    def _update_group(self, index: int, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        by_step: dict[int, list[torch.Tensor]] = {}
        for p in params:
            by_step.setdefault(self._count_step(p), []).append(p)
        update = kernels.get("adam", params[0].device)
        # Params that skipped steps (no grad) have other step counts, hence other corrections.
        for t, same_step in by_step.items():
            update(same_step, [p.grad for p in same_step], [self.state[p]["exp_avg"] for p in same_step],
                   [self.state[p]["exp_avg_sq"] for p in same_step], step=t, lr=float(group["lr"]),
                   betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                   bias_correction=group["bias_correction"], adam_w_mode=group["adam_w_mode"],
                   inv_scale=self._inv_scale, chunk_numel=self.chunk_numel)
