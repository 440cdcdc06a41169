"""The LAMB optimizer (layer-wise adaptive Adam), which torch.optim lacks.

Semantics follow DeepSpeed's ``FusedLamb`` (``optimizer.type: "Lamb"``; You et al. 2019). Per
parameter tensor, with t the step count:

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2
    update = m / (sqrt(v) + eps) + weight_decay * p        (eps_inside_sqrt: m / sqrt(v + eps))
    coeff = clamp(||p|| / ||update||, min_coeff, max_coeff), or 1 when either norm is 0
    step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)     (just lr without bias_correction)
    p = p - step_size * coeff * update

State per parameter: ``exp_avg``, ``exp_avg_sq``, ``step`` (0-dim float tensor, as torch's Adam).
Two passes over cache-sized pieces (``chunks``): the first updates the moments and sums
each parameter's squared norms of weight and update direction; the second recomputes the
direction (cheaper than storing it: no full-size buffer to allocate and fault in) and applies
it with the parameter's trust ratio.

Flattened parameters (ZeRO): the trust ratio is per *original* parameter. When the engine hands
over one flat tensor per group (ZeRO's master vector or this rank's shard of it), it passes one
``FlatLayout`` per group (``zero.partition.FlatLayout.of(numels, start, end)``: which pieces of
which original parameters the tensor holds) and, when each rank holds only a shard, ``norm_all_reduce`` (an
in-place sum over the ranks). Every original parameter then gets its own ratio from its full
norms, exactly as without flattening. The layouts live on the optimizer, not in
``param_groups``, so checkpoints (and reloading them at another world size) never carry a stale
layout. Without a layout a flat tensor is treated as one layer.

Limitations: dense gradients only; no amsgrad (DeepSpeed rejects it as well). With
``norm_all_reduce`` a step is a collective: call it on all ranks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from dslaunch.kernels.chunks import chunked_rows
from dslaunch.runtime.optim.chunks import ChunkedOptimizer
from dslaunch.runtime.zero.partition import FlatLayout

__all__ = ["Lamb"]


class Lamb(ChunkedOptimizer):
    """LAMB with DeepSpeed's defaults (trust ratio clamped to [min_coeff, max_coeff]).

    Args:
        params: parameters or param groups.
        lr: learning rate.
        betas: Adam's (beta1, beta2).
        eps: added to the denominator.
        weight_decay: added to the update (inside the trust ratio, as in LAMB).
        bias_correction: apply Adam's bias correction to the step size.
        max_coeff, min_coeff: bounds of the layer-wise trust ratio.
        eps_inside_sqrt: use sqrt(v + eps) instead of sqrt(v) + eps.
        flat_layouts: one ``FlatLayout`` (or None) per param group holding one flat tensor.
        norm_all_reduce: sums a tensor in place over the ranks sharing flat groups (see the
            module docstring); ``None`` when every rank holds whole parameters.
    """

    moment_keys = ("exp_avg", "exp_avg_sq")
    counts_steps = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, bias_correction: bool = True,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, eps_inside_sqrt: bool = False,
                 flat_layouts: Sequence[FlatLayout | None] | None = None,
                 norm_all_reduce: Callable[[torch.Tensor], None] | None = None):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction, "max_coeff": max_coeff, "min_coeff": min_coeff,
                    "eps_inside_sqrt": eps_inside_sqrt}
        super().__init__(params, defaults)
        self.flat_layouts = list(flat_layouts) if flat_layouts is not None else [None] * len(self.param_groups)
        if len(self.flat_layouts) != len(self.param_groups):
            raise ValueError(f"{len(self.flat_layouts)} flat layouts for {len(self.param_groups)} param groups")
        self.norm_all_reduce = norm_all_reduce

    def _update_group(self, index: int, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        layout = self.flat_layouts[index]
        states = [self._state(p) for p in params]
        # One row per original parameter: the tensors themselves, or views of the pieces of a
        # flat tensor (so a trust ratio never mixes two parameters).
        rows = (params, [p.grad for p in params], [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states])
        if layout is not None:
            rows = self._pieces(layout, rows)
            sizes = [self._step_size(group, self._count_step(params[0]))] * len(rows[0])
        else:
            sizes = [self._step_size(group, self._count_step(p)) for p in params]
        beta1, beta2 = group["betas"]

        # Pass 1: moments, and the squared norms of each row's weight and update direction.
        sq = torch.zeros(2, len(rows[0]), dtype=torch.float64)
        for (ps, gs, ms, vs), row_ids in chunked_rows(rows, self.chunk_numel):
            gs = self._unscaled(gs)
            torch._foreach_lerp_(ms, gs, 1.0 - beta1)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, gs, gs, value=1.0 - beta2)
            direction = self._direction(group, ps, ms, vs)
            pieces = torch.tensor(row_ids)
            sq[0].index_add_(0, pieces, torch.stack(torch._foreach_norm(ps)).double().square())
            sq[1].index_add_(0, pieces, torch.stack(torch._foreach_norm(direction)).double().square())
        ratios = self._trust_ratios(group, layout, sq)  # collective with a reducer

        # Pass 2: recompute the direction (cheaper than storing it: no full-size buffer) and step.
        scales = [-size * ratio for size, ratio in zip(sizes, ratios, strict=True)]
        for (ps, ms, vs), row_ids in chunked_rows((rows[0], rows[2], rows[3]), self.chunk_numel):
            direction = self._direction(group, ps, ms, vs)
            torch._foreach_mul_(direction, [scales[r] for r in row_ids])
            torch._foreach_add_(ps, direction)

    @staticmethod
    def _direction(group: dict[str, Any], ps: list[torch.Tensor], ms: list[torch.Tensor],
                   vs: list[torch.Tensor]) -> list[torch.Tensor]:
        """m / (sqrt(v) + eps) + weight_decay * p, on cache-sized pieces."""
        if group["eps_inside_sqrt"]:
            denom = torch._foreach_add(vs, group["eps"])
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(vs)
            torch._foreach_add_(denom, group["eps"])
        direction = torch._foreach_div(ms, denom)
        if group["weight_decay"] != 0.0:
            torch._foreach_add_(direction, ps, alpha=group["weight_decay"])
        return direction

    @staticmethod
    def _pieces(layout: FlatLayout, rows: tuple[list[torch.Tensor], ...]) -> tuple[list[torch.Tensor], ...]:
        """Split each list's single flat tensor into the views of the layout's segments."""
        if len(rows[0]) != 1:
            raise ValueError("a Lamb param group with a FlatLayout must hold exactly one flat tensor")
        bounds = layout.bounds
        if bounds[-1] != rows[0][0].numel():
            raise ValueError(f"Lamb FlatLayout covers {bounds[-1]} elements, the tensor has {rows[0][0].numel()}")
        return tuple([t[0].view(-1)[a:b] for a, b in itertools.pairwise(bounds)] for t in rows)

    def _trust_ratios(self, group: dict[str, Any], layout: FlatLayout | None, sq: torch.Tensor) -> list[float]:
        """Clamped ||w|| / ||u|| per row from the squared norms ``sq`` (2 x rows)."""
        return self._clamped_ratios(group, *self._full_norms(layout, sq))

    def _full_norms(self, layout: FlatLayout | None, sq: torch.Tensor) -> tuple[list[float], list[float]]:
        """Per row, the norms of its whole original parameter's weight and update (collective with a
        reducer and a layout)."""
        if layout is not None and self.norm_all_reduce is not None:
            # Params split across ranks: add the squared norms of the other ranks' pieces.
            ids = torch.tensor([pid for pid, _ in layout.segments], dtype=torch.long)
            full = torch.zeros(2, layout.num_params, dtype=torch.float64)
            full.index_add_(1, ids, sq)
            self.norm_all_reduce(full)
            sq = full[:, ids]
        # One synchronising .tolist() per group, not one per tensor.
        w_norms, u_norms = sq.sqrt().tolist()
        return w_norms, u_norms

    @staticmethod
    def _clamped_ratios(group: dict[str, Any], w_norms: list[float], u_norms: list[float]) -> list[float]:
        low, high = group["min_coeff"], group["max_coeff"]
        return [min(max(w / u, low), high) if w != 0.0 and u != 0.0 else 1.0
                for w, u in zip(w_norms, u_norms, strict=True)]

    @staticmethod
    def _step_size(group: dict[str, Any], step: int) -> float:
        lr = float(group["lr"])
        if not group["bias_correction"]:
            return lr
        beta1, beta2 = group["betas"]
        return lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
