"""The base class of the hand-written optimizers (Lion, Lamb, Adam, Muon): ``ChunkedOptimizer``.

It holds the torch ``step()`` protocol (closure, params with gradients, sparse check, and torch's
AMP protocol: a ``grad_scale`` the gradients are divided by inside the update, a ``found_inf``
that skips it) and lazily created per-parameter state; subclasses write only their update,
reading gradients through ``_unscaled`` (or handing ``_inv_scale`` to a kernel from
``dslaunch.kernels``, whose reference does the same with ``kernels.chunks.unscaled``) over
cache-sized batches (``kernels.chunks``).
"""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.kernels.chunks import CHUNK_NUMEL, unscaled

__all__ = ["ChunkedOptimizer"]


class ChunkedOptimizer(torch.optim.Optimizer):
    """Base class: ``step()`` calls ``_update_group`` for each group with the params that have grads.

    Class attributes:
        chunk_numel: elements per cache-sized batch (``chunked``).
        moment_keys: per-parameter state tensors, created as zeros shaped like the parameter.
        counts_steps: keep a per-parameter ``step`` (0-dim float tensor, as torch's Adam).
    """

    chunk_numel: int = CHUNK_NUMEL
    moment_keys: tuple[str, ...] = ("exp_avg",)
    counts_steps: bool = False
    # torch's AMP protocol (GradScaler, the ZeRO strategies): set ``grad_scale``/``found_inf``
    # before step(); unscaling happens on cache-sized pieces instead of a separate pass.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch API
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) != 0.0:
            return loss  # the scaler saw inf/nan: skip, as torch's fused optimizers do
        grad_scale = getattr(self, "grad_scale", None)
        self._inv_scale = None if grad_scale is None else 1.0 / float(grad_scale)
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if params:
                self._update_group(index, group, params)
        return loss

    def _update_group(self, index: int, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def _unscaled(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradient pieces divided by ``grad_scale`` (a cache-sized copy; the originals stay)."""
        return unscaled(grads, getattr(self, "_inv_scale", None))

    def _state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """This parameter's state, created on first use."""
        state = self.state[p]
        if not state:
            if self.counts_steps:
                state["step"] = torch.tensor(0.0)
            for key in self.moment_keys:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _count_step(self, p: torch.Tensor) -> int:
        """Advance this parameter's step counter; returns the new count."""
        state = self._state(p)
        # Out of place: a loaded state_dict may share this tensor with another optimizer.
        state["step"] = state["step"] + 1
        return int(state["step"].item())
