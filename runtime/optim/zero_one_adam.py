"""0/1 Adam (``optimizer.type: "ZeroOneAdam"``): 1-bit Adam with ever sparser variance updates and, once
the variance freezes, local steps between ever sparser synchronisations (see the class)."""

from __future__ import annotations

import math
from typing import Any

import torch

from dslaunch.runtime.optim import torch_optimizers
from dslaunch.runtime.optim.compression import compressed_all_reduce, padded_numel
from dslaunch.runtime.optim.onebit import _CompressedMomentum
from dslaunch.runtime.zero.exchange import CompressedExchange

__all__ = ["ZeroOneAdam"]


def _doubling_schedule(step: int, every: int, cap: int) -> tuple[int, int]:
    """(interval at ``step``, step of the last event at or before it) for events whose interval
    starts at 1 and doubles (up to ``cap``) after every ``every`` events; steps count from 1."""
    interval, count, last, t = 1, 0, 0, 0
    while t + interval <= step:
        t += interval
        last, count = t, count + 1
        if count == every:
            count, interval = 0, min(interval * 2, cap)
    return interval, last


class ZeroOneAdam(_CompressedMomentum, torch_optimizers.AdamW):
    """0/1 Adam (DeepSpeed's ``ZeroOneAdam``; Lu et al. 2022): Adam whose variance is updated on ever
    sparser steps and whose ranks, once the variance freezes, take local steps between ever sparser
    synchronisations.

    - Until ``var_freeze_step``: a variance step (the first ones, then every 2nd, 4th, ... step: the
      interval doubles after every ``var_update_scaler`` of them) all-reduces the gradient in fp32 and
      is torch's AdamW step (bitwise); the steps between keep the variance and exchange the momentum
      1-bit compressed (``OneBitAdam``'s compressed step).
    - After it: each rank steps with its own gradient and no communication; every
      ``local_step_interval`` steps (doubling after every ``local_step_scaler`` steps, at most
      ``local_step_clipper``) the ranks average what they moved since the last synchronisation,
      1-bit compressed, and restart from the average (momentum re-derived from it).

    The schedule is a function of the step count, so a checkpoint needs no counters.

    Limitations: ZeRO stage 0 only (between synchronisations every rank holds its own weights,
    which a sharded master cannot); a checkpoint between two synchronisations holds rank 0's
    weights, so resume at a synchronisation step for a bitwise resume.
    """

    _step_supports_amp_scaling = True

    def __init__(self, params: Any, exchange: CompressedExchange, process_group: Any = None,
                 var_freeze_step: int = 100000, var_update_scaler: int = 16, local_step_scaler: int = 32678,
                 local_step_clipper: int = 16, **adamw: Any):
        super().__init__(params, **adamw)
        self._attach(exchange, var_freeze_step, process_group)
        self.var_update_scaler, self.local_step_scaler = var_update_scaler, local_step_scaler
        self.local_step_clipper = local_step_clipper
        exchange.compressing = lambda: not self._variance_step(self.steps_taken() + 1)

    def _variance_step(self, step: int) -> bool:
        if step > self.freeze_step:
            return False
        return _doubling_schedule(step, self.var_update_scaler, 1 << 62)[1] == step

    def _sync_step(self, step: int) -> bool:
        local = step - self.freeze_step
        return _doubling_schedule(local, self.local_step_scaler, self.local_step_clipper)[1] == local

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._forget_momentum()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        step = self.steps_taken() + 1
        return self._step_groups(closure, self._variance_step(step), self._sparse_update)

    def _sparse_update(self, gi: int, group: dict, state: dict, p: torch.Tensor, factor: float) -> None:
        step = int(state["step"]) + 1
        beta1, beta2 = group["betas"]
        last_var = _doubling_schedule(min(step, self.freeze_step), self.var_update_scaler, 1 << 62)[1]
        bc1, bc2_sqrt = 1.0 - beta1**step, math.sqrt(1.0 - beta2**last_var)  # v as of its last update
        denom = state["exp_avg_sq"].sqrt().div_(bc2_sqrt).add_(group["eps"])
        lr = float(group["lr"])
        if step <= self.freeze_step:  # momentum exchanged 1-bit, variance kept
            m = self._exchange_momentum(gi, state, group, factor)
            p.mul_(1.0 - lr * group["weight_decay"])
            p.addcdiv_(m, denom, value=-lr / bc1)
            return
        self._local_step(gi, group, state, p, denom, lr / bc1, factor)
        if self._sync_step(step):
            self._synchronise(gi, group, state, p, denom)

    def _local_step(self, gi: int, group: dict, state: dict, p: torch.Tensor, denom: torch.Tensor,
                    size: float, factor: float) -> None:
        """This rank's own Adam step from its own gradient (``anchor``: the last common weights)."""
        beta1 = group["betas"][0]
        m = state["exp_avg"]
        m.mul_(beta1).add_(self.exchange.local_gradient(gi).float(), alpha=(1.0 - beta1) * factor)
        if "anchor" not in state:
            state["anchor"] = p.detach().clone()
        state["step"] = state["step"] + 1
        p.mul_(1.0 - float(group["lr"]) * group["weight_decay"])
        p.addcdiv_(self._usable(m, state, group), denom, value=-size)
        state["moved_lr"] = float(state.get("moved_lr", 0.0)) + size

    def _synchronise(self, gi: int, group: dict, state: dict, p: torch.Tensor, denom: torch.Tensor) -> None:
        """Average what the ranks moved since the last common weights (1-bit, error feedback); every
        rank restarts from there minus the average, with the momentum that average implies."""
        anchor = state["anchor"]
        lay = self.exchange.layouts[gi]
        buf = torch.zeros(padded_numel(lay.numel, self.world_size), dtype=torch.float32, device=p.device)
        torch.sub(anchor, p, out=buf[:lay.numel])
        if self.world_size > 1:
            errors = self._errors(gi, buf.numel(), buf.device)
            compressed_all_reduce(buf, errors["worker_error"], errors["server_error"], self.world_size, self.pg)
        averaged = self._usable(buf[:lay.numel], state, group)
        p.copy_(anchor.sub_(averaged))  # the same bits on every rank
        state["exp_avg"].copy_(averaged).mul_(denom).div_(state["moved_lr"])
        state["moved_lr"] = 0.0
