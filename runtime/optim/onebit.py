"""1-bit Adam and 1-bit LAMB (``optimizer.type: "OneBitAdam"`` / ``"OneBitLamb"``): optimizers whose
momentum, not their gradient, crosses the network in 1 bit per element after a warm-up.

``OneBitLamb`` is described on its class (its trust ratios); what follows holds for both (and the
exchange for 0/1 Adam, ``zero_one_adam.py``, which builds on the same base).

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
from collections.abc import Callable
from typing import Any

import torch

from dslaunch.errors import CheckpointError
from dslaunch.kernels.chunks import CHUNK_NUMEL, cuts, spans
from dslaunch.runtime.comm import comm
from dslaunch.runtime.heartbeat import wait_all
from dslaunch.runtime.optim import torch_optimizers
from dslaunch.runtime.optim.compression import compressed_all_reduce, padded_numel
from dslaunch.runtime.optim.lamb import Lamb
from dslaunch.runtime.zero.exchange import CompressedExchange
from dslaunch.runtime.zero.partition import FlatLayout

__all__ = ["OneBitAdam", "OneBitLamb"]


class _CompressedMomentum:
    """What the 1-bit optimizers share: the phase, the whole momentum, its compressed exchange.

    Mixed into a torch optimizer whose per-parameter state has ``step``, ``exp_avg`` (this rank's
    shard of the momentum) and ``exp_avg_sq``; one flat master tensor per param group.
    """

    state: Any
    param_groups: list[dict]

    def _attach(self, exchange: CompressedExchange, freeze_step: int, process_group: Any) -> None:
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

    def _forget_momentum(self) -> None:
        self._momentum.clear()  # rebuilt from the loaded exp_avg shards at the next compressed step

    @staticmethod
    def _grad_factor(optimizer: Any) -> float:
        grad_scale = getattr(optimizer, "grad_scale", None)
        return 1.0 if grad_scale is None else 1.0 / float(grad_scale)

    def _whole_momentum(self, gi: int, shard: torch.Tensor) -> torch.Tensor:
        """Group ``gi``'s momentum over the whole flat group, padded for the exchange (every rank the
        same): rebuilt from each rank's ``exp_avg`` shard by one sum when not held yet."""
        if gi not in self._momentum:
            lay = self.exchange.layouts[gi]
            numel, start, end = lay.numel, lay.start, lay.end
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

    def _exchange_momentum(self, gi: int, state: dict, group: dict, factor: float,
                           scaling: list[float] | None = None, store: bool = True) -> torch.Tensor:
        """Update the whole momentum with this rank's own gradient (times ``factor``), average it over
        the ranks 1-bit compressed (each original parameter's piece multiplied by its ``scaling`` while
        compressed, if given) and return it; store this rank's shard in ``exp_avg`` if ``store`` (else
        the caller does: it may want the previous one first; the update masks it: ``_usable``)."""
        lay = self.exchange.layouts[gi]
        numel, start, end = lay.numel, lay.start, lay.end
        beta1 = group["betas"][0]
        m = self._whole_momentum(gi, state["exp_avg"])
        grad = self.exchange.local_gradient(gi).reshape(-1)
        errors = self._errors(gi, m.numel(), m.device) if self.world_size > 1 else None
        scales = scaling if errors is not None else None
        sizes = [math.prod(shape) for shape in lay.shapes]
        bounds = [*lay.offsets, numel]
        # momentum, scaling (in place on views: no n-sized scaling tensor) and worker error feedback on
        # one cache-sized piece at a time: each element sees the whole-tensor ops (bitwise the same)
        for a, b in spans(numel):
            piece = m[a:b].mul_(beta1).add_(grad[a:b].float(), alpha=(1.0 - beta1) * factor)
            if scales is not None:
                where = cuts(bounds, a, b)
                torch._foreach_mul_([piece[lo:hi] for _, lo, hi in where], [scales[i] for i, _, _ in where])
            if errors is not None:
                piece.add_(errors["worker_error"][a:b])
        padding = m[numel:].zero_()  # padding carries nothing (it would only blur the scale)
        if errors is not None:
            padding.add_(errors["worker_error"][numel:])
            compressed_all_reduce(m, errors["worker_error"], errors["server_error"], self.world_size, self.pg,
                                  error_fed=True)
            if scales is not None:
                torch._foreach_div_(list(m[:numel].split(sizes)), scales)
        if store:
            state["exp_avg"].copy_(m[start:end])
        state["step"] = state["step"] + 1
        return m

    def _step_groups(self, closure: Any, plain: bool, update: Callable[..., None]) -> Any:
        """torch's AdamW step if ``plain``, else ``update(gi, group, state, master, grad factor)`` per group."""
        if plain:
            return self._adamw_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        factor = self._grad_factor(self)
        for gi, group in enumerate(self.param_groups):
            (p,) = group["params"]
            update(gi, group, self.state[p], p, factor)
        return loss

    def _adamw_step(self, closure: Any) -> Any:
        """torch's AdamW step (the warm-up and 0/1 Adam's variance steps), unscaling for unfused kernels."""
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is None or self.defaults.get("fused"):  # fused kernels unscale themselves
            return torch_optimizers.AdamW.step(self, closure)
        torch._foreach_mul_([p.grad for g in self.param_groups for p in g["params"] if p.grad is not None],
                            1.0 / float(grad_scale))
        del self.grad_scale  # torch's unfused Adam refuses one
        try:
            return torch_optimizers.AdamW.step(self, closure)
        finally:
            self.grad_scale = grad_scale

    @staticmethod
    def _negligible(v: torch.Tensor, eps: float) -> torch.Tensor:
        """Where the gradients stayed below eps (``v < eps^2``; a key bias, which softmax ignores, is
        ~1e-11): Adam barely moves those, but a compressed momentum gives them a whole sign times the
        scale, divided by ~eps, so the 1-bit steps zero their momentum there. Masked where used, not
        where kept, so the momentum every rank holds (and rebuilds after a load) stays the same
        everywhere. DeepSpeed takes such masks by hand."""
        return v < eps**2

    @classmethod
    def _usable(cls, m: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
        """``m`` with zeros where ``_negligible``."""
        return m.masked_fill(cls._negligible(v, eps), 0.0)

    @staticmethod
    def _adam_denominator(v: torch.Tensor, bc2_sqrt: float, eps: float, out: torch.Tensor) -> torch.Tensor:
        """Adam's ``sqrt(v) / sqrt(1 - beta2^k) + eps`` into ``out``."""
        return torch.sqrt(v, out=out).div_(bc2_sqrt).add_(eps)

    @classmethod
    def _adam_move(cls, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, denom: torch.Tensor, group: dict,
                   size: float) -> None:
        """Adam's step on a piece: ``w`` decays, then moves by ``-size * m / denom`` (``m`` ``_usable``).

        The callers run it on cache-sized pieces (``spans``): whole-tensor temporaries cost more
        than the arithmetic on CPU, their pages faulting in on first touch (BENCHMARKS.md)."""
        w.mul_(1.0 - float(group["lr"]) * group["weight_decay"])
        w.addcdiv_(cls._usable(m, v, group["eps"]), denom, value=-size)

    def _frozen_bias_corrections(self, group: dict, step: float) -> tuple[float, float]:
        """(1 - beta1^t, sqrt(1 - beta2^min(t, freeze_step))): the variance froze with its correction."""
        beta1, beta2 = group["betas"]
        return 1.0 - beta1**step, math.sqrt(1.0 - beta2**min(step, self.freeze_step))


class OneBitAdam(_CompressedMomentum, torch_optimizers.AdamW):
    """Adam (decoupled weight decay) with a 1-bit compressed momentum exchange after ``freeze_step`` steps.

    Args:
        params: the strategy's flat master tensors, one per param group.
        exchange: the strategy's ``CompressedExchange`` (phase switch, error feedback, local gradients).
        freeze_step: warm-up steps (plain Adam) before the variance freezes and compression starts.
        process_group: the data-parallel group the momentum is averaged over.
        **adamw: lr, betas, eps, weight_decay and torch's implementation flags (fused/foreach).

    collective: ``step`` in the compressed phase (all ranks of the group).
    """

    _step_supports_amp_scaling = True  # the strategy hands the unscale/clip factor as grad_scale

    def __init__(self, params: Any, exchange: CompressedExchange, freeze_step: int, process_group: Any = None,
                 **adamw: Any):
        super().__init__(params, **adamw)
        self._attach(exchange, freeze_step, process_group)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._forget_momentum()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return self._step_groups(closure, not self.compressing(), self._compressed_update)

    def _compressed_update(self, gi: int, group: dict, state: dict, p: torch.Tensor, factor: float) -> None:
        self._exchange_momentum(gi, state, group, factor)
        bc1, bc2_sqrt = self._frozen_bias_corrections(group, float(state["step"]))
        w, m, v = p.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        scratch = torch.empty(min(CHUNK_NUMEL, w.numel()), dtype=w.dtype, device=w.device)
        size = float(group["lr"]) / bc1
        for a, b in spans(w.numel()):
            denom = self._adam_denominator(v[a:b], bc2_sqrt, group["eps"], scratch[:b - a])
            self._adam_move(w[a:b], m[a:b], v[a:b], denom, group, size)


class OneBitLamb(_CompressedMomentum, Lamb):
    """LAMB with a 1-bit compressed momentum exchange after ``freeze_step`` steps (DeepSpeed's ``OnebitLamb``).

    Warm-up: dslaunch's ``Lamb`` (bitwise), keeping an average of each parameter's trust ratio
    (``coeff_beta``; the steps where LAMB falls back to 1, a zero weight or update, are left out).
    Compressed phase: the variance freezes; a fresh variance is tracked from the gradients the
    exchanged momentum implies; each parameter's step is LAMB's step size (both bias corrections
    at the current step: the trust ratio cancels the variance's scale, so unlike OneBitAdam's the
    step keeps growing with ``sqrt(1 - beta2^t)``) times its averaged trust ratio times a factor
    ``max(denominator / fresh denominator)`` (with weight decay, mixed towards 1 by the share of the
    update that is not decay), kept in [``factor_min``, ``factor_max``] and within
    ``factor_threshold`` of the last one.

    Args:
        exchange, freeze_step, process_group: as ``OneBitAdam``'s.
        coeff_beta, factor_max, factor_min, factor_threshold: DeepSpeed's names and defaults.
        **lamb: ``Lamb``'s arguments (lr, betas, eps, weight_decay, bias_correction, max_coeff,
            min_coeff, eps_inside_sqrt, flat_layouts, norm_all_reduce).

    Limitations: the averaged trust ratios are per rank (each rank's parameters): a checkpoint
    resumes at the same world size only, as the error feedback.

    collective: ``step`` (as Lamb's with ZeRO, and the exchange).
    """

    def __init__(self, params: Any, exchange: CompressedExchange, freeze_step: int, process_group: Any = None,
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, **lamb: Any):
        super().__init__(params, **lamb)
        self._attach(exchange, freeze_step, process_group)
        self.coeff_beta, self.factor_max, self.factor_min = coeff_beta, factor_max, factor_min
        self.factor_threshold = factor_threshold

    def load_state_dict(self, state_dict: dict) -> None:
        saved = {s.get("coeff_world") for s in state_dict["state"].values()} - {None}
        if saved and saved != {self.world_size}:
            raise CheckpointError(f"OneBitLamb's averaged trust ratios were saved at data-parallel world size "
                                  f"{saved.pop()}, this run has {self.world_size}: they are per rank; resume "
                                  "at the same world size, or load with load_optimizer_states=False")
        super().load_state_dict(state_dict)
        self._restore_float64(state_dict)
        self._forget_momentum()

    def _restore_float64(self, state_dict: dict) -> None:
        """torch's load casts floating state to its parameter's dtype; the trust ratios' averages
        are float64 (a resume would round them to fp32 and step differently)."""
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, p in zip(saved_ids, params, strict=True):
            for key, value in state_dict["state"].get(pid, {}).items():
                if torch.is_tensor(value) and value.dtype == torch.float64:
                    self.state[p][key] = value.to(self.state[p][key].device, copy=True)

    def _layout(self, index: int, p: torch.Tensor) -> FlatLayout:
        return self.flat_layouts[index] or FlatLayout(((0, p.numel()),), 1)

    def _update_group(self, index: int, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        if not self.compressing():
            super()._update_group(index, group, params)
            return
        (p,) = params
        state = self.state[p]
        layout = self._layout(index, p)
        lay = self.exchange.layouts[index]
        m = self._exchange_momentum(index, state, group, self._inv_scale or 1.0, self._scaling(index, state),
                                    store=False)
        if "exp_avg_sq_fresh" not in state:  # not setdefault: its default would be cloned every step
            state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
        stats = self._moments_and_stats(index, group, layout, state, m[lay.start:lay.end], p.view(-1))
        if group["weight_decay"] != 0.0:
            share = (stats[1] / stats[2]).sqrt().clamp_(max=1.0).nan_to_num_(1.0)
            stats[0] = stats[0] * share + (1.0 - share)
        factor = stats[0].clamp_(self.factor_min, self.factor_max)
        last = state.setdefault("last_factor", torch.ones_like(factor))
        factor = torch.minimum(torch.maximum(factor, last * (1.0 - self.factor_threshold)),
                               last * (1.0 + self.factor_threshold))
        last.copy_(factor)
        # LAMB's own step size, the variance's correction not frozen: LAMB's trust ratio cancels the
        # scale of its update, so its step keeps growing with sqrt(1 - beta2^t) while the variance
        # warms up; frozen (as OneBitAdam's, whose update does use the variance) it lagged ~2x at 40 steps
        size = self._step_size(group, int(state["step"]))
        self._apply(group, layout, state, p.view(-1), (self._averaged_ratios(state) * factor * -size).tolist())

    def _moments_and_stats(self, index: int, group: dict[str, Any], layout: FlatLayout, state: dict,
                           new: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The compressed step's first pass, on cache-sized pieces (no n-sized temporaries): the fresh
        variance from the averaged gradient the exchanged momentum ``new`` implies, ``exp_avg`` = ``new``,
        and per original parameter over all ranks (float64, rows): the max of denominator / fresh
        denominator and, with weight decay, the sums of squares of the update and the decayed update."""
        beta1, beta2 = group["betas"]
        decay = group["weight_decay"]
        old, v, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
        bounds = layout.bounds
        pids = [pid for pid, _ in layout.segments]
        out = torch.zeros(3 if decay != 0.0 else 1, layout.num_params, dtype=torch.float64)
        buf1, buf2 = torch.empty(2, min(CHUNK_NUMEL, new.numel()), dtype=new.dtype, device=new.device)
        for a, b in spans(new.numel()):
            t1, t2 = buf1[:b - a], buf2[:b - a]
            implied = torch.sub(new[a:b], old[a:b], alpha=beta1, out=t1).div_(1.0 - beta1)
            fresh[a:b].mul_(beta2).addcmul_(implied, implied, value=1.0 - beta2)
            old[a:b].copy_(new[a:b])
            denom = self._denominator(group, v[a:b], t1)
            ratio = torch.div(denom, self._denominator(group, fresh[a:b], t2), out=t2)
            where = cuts(bounds, a, b)
            ids = torch.tensor([pids[row] for row, _, _ in where], dtype=torch.long)
            maxima = torch.stack(torch._foreach_max([ratio[lo:hi] for _, lo, hi in where])).double()
            out[0, ids] = torch.maximum(out[0, ids], maxima)  # a parameter has one piece per span
            if decay != 0.0:
                update = self._masked_update(group, new[a:b], v[a:b], denom)
                decayed = torch.add(update, weights[a:b], alpha=decay, out=t2)
                for row, t in ((1, update), (2, decayed)):
                    norms = torch._foreach_norm([t[lo:hi] for _, lo, hi in where])
                    out[row].index_add_(0, ids, torch.stack(norms).double().square())
        lay = self.exchange.layouts[index]
        if self.world_size > 1 and (lay.start, lay.end) != (0, lay.numel):  # sharded: parameters span ranks
            handles = [comm.all_reduce(out[:1], op=comm.ReduceOp.MAX, group=self.pg, async_op=True)]
            if decay != 0.0:
                handles.append(comm.all_reduce(out[1:], op=comm.ReduceOp.SUM, group=self.pg, async_op=True))
            wait_all(tuple(handles), "1-bit LAMB statistics")
        return out

    def _apply(self, group: dict[str, Any], layout: FlatLayout, state: dict, weights: torch.Tensor,
               scales: list[float]) -> None:
        """The second pass: each original parameter's piece of ``weights`` moves by its scale times the
        (masked, decayed) update, recomputed on cache-sized pieces (cheaper than keeping it n-sized).
        Pieces start at multiples of ``CHUNK_NUMEL`` within each parameter, as ``spans`` requires."""
        m, v, decay = state["exp_avg"], state["exp_avg_sq"], group["weight_decay"]
        buf1, buf2 = torch.empty(2, min(CHUNK_NUMEL, m.numel()), dtype=m.dtype, device=m.device)
        bounds = layout.bounds
        for (pid, length), start in zip(layout.segments, bounds[:-1], strict=True):
            for a, b in spans(length):
                a, b = start + a, start + b
                update = self._masked_update(group, m[a:b], v[a:b], self._denominator(group, v[a:b], buf1[:b - a]))
                if decay != 0.0:
                    update = torch.add(update, weights[a:b], alpha=decay, out=buf2[:b - a])
                weights[a:b].add_(update, alpha=scales[pid])

    @classmethod
    def _masked_update(cls, group: dict[str, Any], m: torch.Tensor, v: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
        """m / ``denom`` (v's denominator, overwritten), zero where ``_negligible`` (``_usable``'s mask,
        applied after the division: 0 / d is the masked momentum's value)."""
        return torch.div(m, denom, out=denom).masked_fill_(cls._negligible(v, group["eps"]), 0.0)

    def _scaling(self, index: int, state: dict) -> list[float]:
        """Per original parameter, its momentum scaling (DeepSpeed's ``scaling_coeff``): the mean of
        the parameters' RMS momenta over its own, fixed when compression starts. One scale per chunk
        would otherwise drown the parameters with small momenta in the large ones' signs."""
        lay = self.exchange.layouts[index]
        sizes = [math.prod(shape) for shape in lay.shapes]
        if "scaling_coeff" not in state:
            m = self._whole_momentum(index, state["exp_avg"])[:lay.numel]
            rms = torch.stack([piece.norm() / math.sqrt(piece.numel()) for piece in m.split(sizes)])
            state["scaling_coeff"] = (rms.mean() / rms).nan_to_num_(1.0, 1.0, 1.0)
        return state["scaling_coeff"].tolist()

    @staticmethod
    def _denominator(group: dict[str, Any], v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if group["eps_inside_sqrt"]:
            return torch.add(v, group["eps"], out=out).sqrt_()
        return torch.sqrt(v, out=out).add_(group["eps"])

    def _trust_ratios(self, group: dict[str, Any], layout: FlatLayout | None, sq: torch.Tensor) -> list[float]:
        w_norms, u_norms = self._full_norms(layout, sq)
        ratios = self._clamped_ratios(group, w_norms, u_norms)
        layout = layout or FlatLayout(tuple((i, 1) for i in range(len(ratios))), len(ratios))
        state = self.state[group["params"][0]]
        coeff = state.setdefault("lamb_coeff", torch.zeros(layout.num_params, dtype=torch.float64))
        weight = state.setdefault("lamb_coeff_weight", torch.zeros_like(coeff))
        state["coeff_world"] = self.world_size
        # the average the compressed phase starts from (DeepSpeed's lamb_coeff_freeze), over the steps
        # with a real ratio: a zero-initialised bias's first ratio is LAMB's fallback 1, ~100x its later
        # ones (averaged in, it made such parameters step ~6x too far once compressed)
        real = [(pid, r) for (pid, _), r, w, u in zip(layout.segments, ratios, w_norms, u_norms, strict=True)
                if w != 0.0 and u != 0.0]
        if real:
            ids = torch.tensor([pid for pid, _ in real], dtype=torch.long)
            seen = torch.tensor([r for _, r in real], dtype=torch.float64)
            coeff.index_copy_(0, ids, coeff[ids] * self.coeff_beta + seen * (1.0 - self.coeff_beta))
            weight.index_copy_(0, ids, weight[ids] * self.coeff_beta + (1.0 - self.coeff_beta))
        return ratios

    def _averaged_ratios(self, state: dict) -> torch.Tensor:
        """The warm-up's averaged trust ratios, bias-corrected (the average started from zero; a
        parameter that never had a real ratio gets 1, LAMB's fallback)."""
        weight = state.get("lamb_coeff_weight")
        if weight is None:  # a checkpoint from before the weights were kept: every warm-up step counted
            weight = torch.full_like(state["lamb_coeff"], 1.0 - self.coeff_beta**self.freeze_step)
        return torch.where(weight > 0, state["lamb_coeff"] / weight.clamp(min=1e-300), 1.0)

