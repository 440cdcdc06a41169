"""DeepSpeed's optimizer classes over dslaunch's kernels: ``DeepSpeedCPUAdam``, ``DeepSpeedCPUAdagrad``,
``DeepSpeedCPULion`` (re-exported by ``dslaunch.ops.adam``/``.adagrad``/``.lion``; ``FusedAdam``,
built on ``DeepSpeedCPUAdam``, is ``dslaunch.kernels.fused_adam``'s).

Constructor arguments, defaults, state keys (``step`` as an int, ``exp_avg``, ``exp_avg_sq``) and
``step()`` semantics follow DeepSpeed 0.19.8. The update is the ``"cpu_adam"`` (DeepSpeed's
rounding, not torch's), ``"adagrad"`` or ``"lion"`` op of ``dslaunch.kernels``: the C kernels on
CPU (no JIT build of minutes: the library compiles in well under a second on first use), the torch
reference elsewhere or with ``DSLAUNCH_KERNELS=reference``. States of 4 MiB or more are advised onto
huge pages. Parameters that are not fp32 (or states kept in the parameter dtype,
``fp32_optimizer_states=False``) are updated through fp32 copies, as DeepSpeed computes in fp32.

Sparse gradients (``nn.Embedding(sparse=True)``) are taken by ``DeepSpeedCPUAdagrad`` as by
DeepSpeed's: only the rows the gradient holds are updated, through the same kernel.

Limitations: no ``step_subgroup``/``rollback_subgroup`` (ZeRO-3 offload's per-subgroup calls);
sparse gradients are refused by the Adam and Lion classes (as DeepSpeed's).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from dslaunch import kernels
from dslaunch.kernels.cpu import build, ops

__all__ = ["DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion"]

_F32, _STRIDED = torch.float32, torch.strided
Entry = tuple[torch.Tensor, dict[str, Any]]  # a parameter and its state
# States from this size on are advised onto huge pages (2 MiB each; a smaller tensor holds none whole).
_HUGE_MIN = 4 << 20


class _KernelOptimizer(torch.optim.Optimizer):
    """``step()``: the parameters with a gradient, states created lazily and ``step += 1`` each,
    then one call of the ``op`` kernel per batch of parameters sharing a device and a step count
    (one C call for a whole list of small tensors, not one each)."""

    op: ClassVar[str]
    state_keys: ClassVar[tuple[str, ...]]
    cpu_only: ClassVar[bool] = True
    sparse_rows: ClassVar[bool] = False  # a sparse gradient updates its rows only (Adagrad)

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], fp32_optimizer_states: bool = True):
        super().__init__(params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            sparse: list[Entry] = []
            for (device, step), batch in self._batches(group, sparse).items():
                self._update_batch(group, device, step, batch)
            for p, state in sparse:
                self._update_rows(group, p, state)
        return loss

    def _batches(self, group: dict[str, Any], sparse: list[Entry]) -> dict[tuple[Any, int], list[Entry]]:
        """The group's parameters with a dense gradient, and their states, by (device, step); those
        with a sparse one appended to ``sparse``; steps counted."""
        batches: dict[tuple[Any, int], list[Entry]] = {}
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            # is_cpu first: it runs per parameter per step, and building p.device costs 0.6 us.
            device = "cpu" if p.is_cpu else p.device
            if self.cpu_only and device != "cpu":
                raise RuntimeError(f"{type(self).__name__}: a parameter is on {p.device} and must be on the "
                                   "CPU; enable 'offload_optimizer': {'device': 'cpu'} in the ZeRO config")
            dense = grad.layout is _STRIDED  # not is_sparse: 2x the cost, and blind to CSR
            if not dense and not (self.sparse_rows and grad.layout is torch.sparse_coo):
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self._state(group, p)
            state["step"] += 1
            if dense:
                batches.setdefault((device, state["step"]), []).append((p, state))
            else:
                sparse.append((p, state))
        return batches

    def _update_rows(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        """A sparse (COO) gradient: the rows it holds, gathered, updated by the kernel, put back."""
        grad = p.grad.coalesce()
        where = tuple(grad.indices())
        tensors = [p, *(state[k] for k in self.state_keys)]
        rows = [t[where].float() for t in tensors]  # copies: contiguous, fp32
        kernels.get(self.op, "cpu")([rows[0]], [grad.values().float().contiguous()], *([r] for r in rows[1:]),
                                    **self._arguments(group, state["step"]))
        for t, r in zip(tensors, rows, strict=True):
            t[where] = r.to(t.dtype)

    def _update_batch(self, group: dict[str, Any], device: torch.device | str, step: int,
                      batch: list[Entry]) -> None:
        update = kernels.get(self.op, device)
        # DeepSpeed computes in fp32: kernels that do not take other dtypes as they are
        # (``handles_dtypes``: the Triton Adam) get contiguous fp32 copies, written back.
        keep_dtype = getattr(update, "handles_dtypes", False)
        # The parameters themselves, not p.data (0.4 us each): step() runs under no_grad.
        lists = [[p for p, _ in batch], [p.grad for p, _ in batch],
                 *([state[k] for _, state in batch] for k in self.state_keys)]
        staged = [[t if t.dtype is _F32 and t.is_contiguous() else _staged(t, keep_dtype) for t in ts]
                  for ts in lists]
        update(*staged, **self._arguments(group, step))
        for ts, ss in zip(lists[:1] + lists[2:], staged[:1] + staged[2:], strict=True):  # not the grads
            for t, s in zip(ts, ss, strict=True):
                if s is not t:
                    t.copy_(s)

    def _state(self, group: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
            for key in self.state_keys:
                state[key] = _zeros_like(p, dtype)
        return state

    def _arguments(self, group: dict[str, Any], step: int) -> dict[str, Any]:
        """The keyword arguments of the ``op`` kernel for this group at this step."""
        raise NotImplementedError


def _zeros_like(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros_like(p, dtype=dtype)``; a large CPU one on huge pages where the OS has them.

    The advice must come before the first write (zeroing), which then faults huge pages in: the
    update streams its states once per step, and over 4 KiB pages each tensor costs TLB misses
    (huge-paged states made a 20M-element Adam step ~3.5% faster here).
    """
    t = torch.empty_like(p, dtype=dtype)
    if t.is_cpu and t.numel() * t.element_size() >= _HUGE_MIN and build.available():
        ops.advise_huge_pages(t)
    return t.zero_()


def _staged(t: torch.Tensor, keep_dtype: bool) -> torch.Tensor:
    """A contiguous copy of ``t``, fp32 unless ``keep_dtype``, or ``t`` itself if it is one."""
    if t.dtype is _F32 or keep_dtype:
        return t if t.is_contiguous() else t.contiguous()
    return t.float().contiguous()


class DeepSpeedCPUAdam(_KernelOptimizer):
    """Adam/AdamW on CPU parameters (DeepSpeed's ``deepspeed.ops.adam.DeepSpeedCPUAdam``).

    Args:
        model_params: parameters or param groups (on the CPU).
        lr, betas, eps, weight_decay: as torch's Adam.
        bias_correction: divide the moments by (1 - beta^t).
        amsgrad: must be False (DeepSpeed refuses it too).
        adamw_mode: decoupled weight decay (AdamW) instead of L2; for the whole optimizer.
        fp32_optimizer_states: keep the moments in fp32 whatever the parameter dtype.
    """

    op = "cpu_adam"  # DeepSpeed's rounding (one division per element), not torch's: see the kernel
    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction, "amsgrad": amsgrad}
        super().__init__(model_params, defaults, fp32_optimizer_states)
        self.adam_w_mode = adamw_mode

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("amsgrad", self.defaults["amsgrad"]):
            raise RuntimeError(f"{type(self).__name__} does not support the AMSGrad variant.")
        super().add_param_group(param_group)

    def _arguments(self, group, step):
        return {"step": step, "lr": float(group["lr"]), "betas": group["betas"], "eps": group["eps"],
                "weight_decay": group["weight_decay"], "bias_correction": group["bias_correction"],
                "adam_w_mode": bool(self.adam_w_mode), "inv_scale": None}


class DeepSpeedCPUAdagrad(_KernelOptimizer):
    """Adagrad on CPU parameters (DeepSpeed's ``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``).

    ``g += weight_decay * p; exp_avg_sq += g^2; p -= lr * g / (sqrt(exp_avg_sq) + eps)``.
    """

    op = "adagrad"
    state_keys = ("exp_avg_sq",)
    sparse_rows = True

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True):
        super().__init__(model_params, {"lr": lr, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad},
                         fp32_optimizer_states)

    def _arguments(self, group, step):
        return {"clr": float(group["lr"]), "eps": group["eps"], "weight_decay": group["weight_decay"],
                "inv_scale": None}


class DeepSpeedCPULion(_KernelOptimizer):
    """Lion on CPU parameters (DeepSpeed's ``deepspeed.ops.lion.DeepSpeedCPULion``)."""

    op = "lion"
    state_keys = ("exp_avg",)

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0, fp32_optimizer_states: bool = True):
        super().__init__(model_params, {"lr": lr, "betas": betas, "weight_decay": weight_decay},
                         fp32_optimizer_states)

    def _arguments(self, group, step):
        return {"lr": float(group["lr"]), "betas": group["betas"], "weight_decay": group["weight_decay"],
                "inv_scale": None}
