"""``deepspeed.ops.lion``: DeepSpeedCPULion (owned by ``dslaunch.kernels.cpu.optimizers``) and
FusedLion: ``dslaunch.runtime.optim.lion.Lion`` (its kernel per device) under DeepSpeed's name."""

from collections.abc import Iterable
from typing import Any

from dslaunch.kernels.cpu.optimizers import DeepSpeedCPULion
from dslaunch.runtime.optim.lion import Lion

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class FusedLion(Lion):
    """DeepSpeed's ``FusedLion(params, lr, betas, weight_decay, set_grad_none)``: dslaunch's Lion.
    ``set_grad_none`` is accepted for its signature; ``zero_grad`` sets gradients to None by default."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
