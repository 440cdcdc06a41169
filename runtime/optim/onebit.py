"""1-bit Adam (``optimizer.type: "OneBitAdam"``): Adam whose momentum, not its gradient, crosses the network
in 1 bit per element after a warm-up.

Two phases (Tang et al. 2021; DeepSpeed's ``OnebitAdam`` config keys):

- warm-up, the first ``freeze_step`` steps: exactly torch's AdamW (the class the engine builds for
  ``"Adam"``), on gradients the strategy all-reduced as usual: bitwise the same weights as plain Adam;
- compressed phase: the variance ``exp_avg_sq`` is frozen; the gradient stays on its rank
  (``zero.exchange.CompressedExchange``); each rank updates the momentum with its own whole gradient,
  then the ranks average the momentum with ``compression.compressed_all_reduce`` (sign + one scale,
  worker and server error feedback) and take the Adam step with it.

Differences from DeepSpeed, on purpose: the warm-up steps from the first step (DeepSpeed's first step
does not update) with bias correction, and the compressed phase keeps the bias correction of the
momentum (``1 - beta1^t``) and the one of the variance frozen at ``freeze_step``, so the update is
continuous with the warm-up (DeepSpeed applies no bias correction at all). The error feedback is
checkpointed per rank (DeepSpeed resets it on every load), so a resume is bitwise.

ZeRO: the full momentum is kept on every rank in the compressed phase (the exchange needs the whole
local momentum, identical on all ranks after it); ``exp_avg`` (this rank's shard of it, what
checkpoints hold) and ``exp_avg_sq`` are sharded as usual; at the first compressed step (and after a
load) the whole momentum is rebuilt from the shards with one all-reduce.

Limitations: ZeRO stages 0-2 (stage 2 keeps stage 1's full gradient buffer, since the compressed
phase needs each rank's whole gradient); no fp16 loss scaling (a rank that skips a step would leave
its peers in the exchange); ``gradient_clipping`` in the compressed phase clips each rank's local
gradient with the norm of the local gradients.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dslaunch import comm
from dslaunch.runtime.heartbeat import wait_all
from dslaunch.runtime.optim import torch_optimizers
from dslaunch.runtime.optim.compression import compressed_all_reduce, padded_numel
from dslaunch.runtime.zero.exchange import CompressedExchange

__all__ = ["OneBitAdam"]


class OneBitAdam(torch_optimizers.AdamW):
    """Adam (decoupled weight decay) with a 1-bit compressed momentum exchange after ``freeze_step`` steps.

    Args:
        params: the strategy's flat master tensors, one per param group.
        exchange: the strategy's ``CompressedExchange`` (phase switch, error feedback, local gradients).
        freeze_step: warm-up steps (plain Adam) before the variance freezes and compression starts.
        world_size, rank, process_group: the data-parallel group the momentum is averaged over.
        **adamw: lr, betas, eps, weight_decay and torch's implementation flags (fused/foreach).

    collective: ``step`` in the compressed phase (all ranks of the group).
    """

    _step_supports_amp_scaling = True  # the strategy hands the unscale/clip factor as grad_scale

    def __init__(self, params: Any, exchange: CompressedExchange, freeze_step: int, process_group: Any = None,
                 **adamw: Any):
        super().__init__(params, **adamw)
        self.exchange, self.freeze_step, self.pg = exchange, freeze_step, process_group
        self.world_size = exchange.world_size
        self._momentum: dict[int, torch.Tensor] = {}  # group -> whole momentum (padded), compressed phase
        exchange.compressing = self.compressing

    def steps_taken(self) -> int:
        state = self.state.get(self.param_groups[0]["params"][0], {})
        return int(state["step"]) if "step" in state else 0

    def compressing(self) -> bool:
        """Whether the next step is a compressed one (gradients then stay local)."""
        return self.steps_taken() >= self.freeze_step

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._momentum.clear()  # rebuilt from the loaded exp_avg shards at the next compressed step

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if not self.compressing():
            return self._warmup_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        factor = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        for gi, group in enumerate(self.param_groups):
            self._compressed_group(gi, group, factor)
        return loss

    def _warmup_step(self, closure: Any) -> Any:
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is not None and not self.defaults.get("fused"):  # only fused kernels unscale
            del self.grad_scale
            torch._foreach_mul_([p.grad for g in self.param_groups for p in g["params"] if p.grad is not None],
                                1.0 / float(grad_scale))
        return super().step(closure)

    def _whole_momentum(self, gi: int, shard: torch.Tensor) -> torch.Tensor:
        """Group ``gi``'s momentum over the whole flat group, padded for the exchange (every rank the
        same): rebuilt from each rank's ``exp_avg`` shard by one sum when not held yet."""
        if gi not in self._momentum:
            numel, start, end = self.exchange.spans[gi]
            m = torch.zeros(padded_numel(numel, self.world_size), dtype=torch.float32, device=shard.device)
            m[start:end].copy_(shard)
            if (start, end) != (0, numel) and self.world_size > 1:  # sharded: gather the others' pieces
                wait_all((comm.all_reduce(m, group=self.pg, async_op=True),), "1-bit momentum rebuild")
            self._momentum[gi] = m
        return self._momentum[gi]

    def _errors(self, gi: int, padded: int, device: torch.device) -> dict[str, torch.Tensor]:
        errors = self.exchange.errors.get(gi)
        if errors is None:
            errors = self.exchange.errors[gi] = {
                "worker_error": torch.zeros(padded, dtype=torch.float32, device=device),
                "server_error": torch.zeros(padded // self.world_size, dtype=torch.float32, device=device)}
        return errors

    def _compressed_group(self, gi: int, group: dict, factor: float) -> None:
        (p,) = group["params"]
        state = self.state[p]
        numel, start, end = self.exchange.spans[gi]
        m = self._whole_momentum(gi, state["exp_avg"])
        beta1, beta2 = group["betas"]
        local = self.exchange.local_gradient(gi)
        m[:numel].mul_(beta1).add_(local.float(), alpha=(1.0 - beta1) * factor)
        m[numel:].zero_()  # padding carries nothing (it would only blur the scale)
        if self.world_size > 1:
            errors = self._errors(gi, m.numel(), m.device)
            compressed_all_reduce(m, errors["worker_error"], errors["server_error"], self.world_size, self.pg)
        state["exp_avg"].copy_(m[start:end])
        state["step"] += 1
        t = float(state["step"])
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        bc1 = 1.0 - beta1**t
        bc2_sqrt = math.sqrt(1.0 - beta2**min(t, self.freeze_step))  # the variance froze with its correction
        p.mul_(1.0 - lr * wd)
        denom = state["exp_avg_sq"].sqrt().div_(bc2_sqrt).add_(eps)
        p.addcdiv_(state["exp_avg"], denom, value=-lr / bc1)
