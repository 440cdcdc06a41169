"""0/1 Adam (``optimizer.type: "ZeroOneAdam"``): 1-bit Adam with ever sparser variance updates and, once
the variance freezes, local steps between ever sparser synchronisations (see the class)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from dslaunch.kernels.chunks import CHUNK_NUMEL, spans
from dslaunch.runtime.optim import torch_optimizers
from dslaunch.runtime.optim.compression import compressed_all_reduce, padded_numel
from dslaunch.runtime.optim.onebit import _CompressedMomentum
from dslaunch.runtime.zero.exchange import CompressedExchange

__all__ = ["ZeroOneAdam"]

Denominator = Callable[[int, int], torch.Tensor]  # [a, b) -> Adam's denominator of those elements


def _doubling_schedule(step: int, every: int) -> tuple[int, int]:
    """(how many events happened at steps <= ``step``, the step of the last one) for events whose
    interval starts at 1 and doubles after every ``every`` events; steps count from 1."""
    interval, count, t = 1, 0, 0
    while t + interval <= step:
        t += interval
        count += 1
        if count % every == 0:
            interval *= 2
    return count, t


class ZeroOneAdam(_CompressedMomentum, torch_optimizers.AdamW):
    """0/1 Adam (DeepSpeed's ``ZeroOneAdam``; Lu et al. 2022): Adam whose variance is updated on ever
    sparser steps and whose ranks, once the variance freezes, take local steps between ever sparser
    synchronisations.

    - Until ``var_freeze_step``: a variance step (the first ones, then every 2nd, 4th, ... step: the
      interval doubles after every ``var_update_scaler`` of them) all-reduces the gradient in fp32 and
      updates both moments; the steps between average the gradient 1-bit compressed (error fed) into
      the momentum and keep the variance (DeepSpeed's). The variance's bias correction counts its
      updates, not the steps; while they are the same (the first ``var_update_scaler`` steps) a step
      is torch's AdamW step (bitwise).
    - After it: each rank steps with its own gradient and no communication; every
      ``local_step_interval``-th local step (the interval doubling after every ``local_step_scaler``
      local steps, at most ``local_step_clipper``) the ranks average the momenta they stepped with
      since the last synchronisation (what they moved times the denominator), 1-bit compressed, and
      restart from the last common weights moved by that average, with the momentum it implies. The
      error feedback restarts at zero with this phase (it held gradients before), as DeepSpeed's does.

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
        self._buffers: dict[int, torch.Tensor] = {}  # group -> the compressed all-reduce's buffer

    def _variance_step(self, step: int) -> bool:
        return step <= self.freeze_step and _doubling_schedule(step, self.var_update_scaler)[1] == step

    def _sync_step(self, step: int) -> bool:
        """Whether local step ``step - var_freeze_step`` (from 1) ends with a synchronisation: every
        ``interval``-th one, the interval doubling (up to the clipper) after every ``local_step_scaler``
        local steps (DeepSpeed's counter counts steps, not synchronisations)."""
        local = step - self.freeze_step
        interval = min(self.local_step_clipper, 1 << min((local - 1) // self.local_step_scaler, 62))
        return local % interval == 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        step = self.steps_taken() + 1
        # torch's AdamW while every step so far updated the variance (its bias correction counts steps)
        plain = _doubling_schedule(min(step, self.freeze_step), self.var_update_scaler)[0] == step
        return self._step_groups(closure, plain, self._sparse_update)

    def _sparse_update(self, gi: int, group: dict, state: dict, p: torch.Tensor, factor: float) -> None:
        """One step, on cache-sized pieces (``spans``; no temporaries of the parameters' size)."""
        step = int(state["step"]) + 1
        beta1, beta2 = group["betas"]
        w, m, v = p.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        # Adam's denominator: the variance's bias correction counts its updates, not the steps
        # (torch's, by steps, would shrink the denominator ~sqrt(steps / updates)x)
        bc2_sqrt = math.sqrt(1.0 - beta2 ** _doubling_schedule(min(step, self.freeze_step), self.var_update_scaler)[0])
        scratch = torch.empty(min(CHUNK_NUMEL, w.numel()), dtype=torch.float32, device=w.device)

        def denominator(a: int, b: int) -> torch.Tensor:
            return self._adam_denominator(v[a:b], bc2_sqrt, group["eps"], scratch[:b - a])

        size = float(group["lr"]) / (1.0 - beta1**step)
        if step <= self.freeze_step:
            if self._variance_step(step):  # the gradient all-reduced in fp32: both moments
                grad = p.grad.view(-1)
                for a, b in spans(w.numel()):
                    g = grad[a:b].float() * factor
                    m[a:b].mul_(beta1).add_(g, alpha=1.0 - beta1)
                    v[a:b].mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                    self._adam_move(w[a:b], m[a:b], v[a:b], denominator(a, b), group, size)
            else:
                averaged = self._exchange_gradient(gi, factor, denominator)
                for a, b in spans(w.numel()):
                    denom = denominator(a, b)
                    m[a:b].mul_(beta1).add_(averaged[a:b].mul_(denom), alpha=1.0 - beta1)
                    self._adam_move(w[a:b], m[a:b], v[a:b], denom, group, size)
            state["step"] = state["step"] + 1
            return
        if step == self.freeze_step + 1:  # what the errors hold is gradients, the exchange moves momenta now
            for error in self.exchange.errors.get(gi, {}).values():
                error.zero_()
        self._local_step(gi, group, state, p, factor, size, denominator)
        if self._sync_step(step):
            self._synchronise(gi, group, state, p.view(-1), denominator)

    def _exchange_buffer(self, gi: int, device: torch.device) -> torch.Tensor:
        """Group ``gi``'s buffer for the compressed all-reduce (padded), kept between steps: a fresh
        one each step cost more than the step's arithmetic (its pages fault in)."""
        if gi not in self._buffers:
            padded = padded_numel(self.exchange.layouts[gi].numel, self.world_size)
            self._buffers[gi] = torch.empty(padded, dtype=torch.float32, device=device)
        return self._buffers[gi]

    def _all_reduce_compressed(self, gi: int, buf: torch.Tensor) -> None:
        buf[self.exchange.layouts[gi].numel:].zero_()  # padding carries nothing
        if self.world_size > 1:
            errors = self._errors(gi, buf.numel(), buf.device)
            compressed_all_reduce(buf, errors["worker_error"], errors["server_error"], self.world_size, self.pg)

    def _exchange_gradient(self, gi: int, factor: float, denominator: Denominator) -> torch.Tensor:
        """This rank's gradient (times ``factor``) averaged over the ranks 1-bit compressed, error fed,
        divided by Adam's denominator (the caller multiplies it back) (DeepSpeed's 0/1 Adam;
        compressing the momentum, as 1-bit Adam does, would also compress the part every rank
        already shares, ``beta1`` times the last momentum: more noise for no news).

        Compressed divided by the denominator (the same on every rank): one scale for all elements
        fits g / denom (the update's direction, of similar size everywhere) better than g, whose
        sizes differ by orders of magnitude between parameters, so the sign noise lands evenly on
        the update (DeepSpeed compresses g itself). The error feedback holds that scaled residual; a
        variance step between two exchanges rescales it slightly."""
        grad = self.exchange.local_gradient(gi).view(-1)
        buf = self._exchange_buffer(gi, grad.device)
        for a, b in spans(grad.numel()):
            buf[a:b].copy_(grad[a:b]).mul_(factor).div_(denominator(a, b))
        self._all_reduce_compressed(gi, buf)
        return buf

    def _local_step(self, gi: int, group: dict, state: dict, p: torch.Tensor, factor: float, size: float,
                    denominator: Denominator) -> None:
        """This rank's own Adam step from its own gradient (``anchor``: the last common weights)."""
        w, m, v = p.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        beta1 = group["betas"][0]
        if "anchor" not in state:
            state["anchor"] = p.detach().clone()
        grad = self.exchange.local_gradient(gi).view(-1)
        for a, b in spans(w.numel()):
            m[a:b].mul_(beta1).add_(grad[a:b].float(), alpha=(1.0 - beta1) * factor)
            self._adam_move(w[a:b], m[a:b], v[a:b], denominator(a, b), group, size)
        state["step"] = state["step"] + 1
        state["moved_lr"] = float(state.get("moved_lr", 0.0)) + size

    def _synchronise(self, gi: int, group: dict, state: dict, w: torch.Tensor, denominator: Denominator) -> None:
        """Average what the ranks moved since the last common weights, times the denominator (the
        momenta they stepped with, weighted by their step sizes: 0/1 Adam's ``u``), 1-bit with error
        feedback; every rank restarts from there, with the momentum that average implies. Compressed as
        momenta, not moves: one scale for all elements suits momenta, whose sizes vary less."""
        anchor, m, v = state["anchor"].view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        buf = self._exchange_buffer(gi, w.device)
        for a, b in spans(w.numel()):
            torch.sub(anchor[a:b], w[a:b], out=buf[a:b]).mul_(denominator(a, b))
        self._all_reduce_compressed(gi, buf)
        for a, b in spans(w.numel()):
            averaged = buf[a:b].masked_fill_(self._negligible(v[a:b], group["eps"]), 0.0)  # ``_usable``, in place
            m[a:b].copy_(averaged).div_(state["moved_lr"])
            w[a:b].copy_(anchor[a:b].sub_(averaged.div_(denominator(a, b))))  # the same bits on every rank
        state["moved_lr"] = 0.0
