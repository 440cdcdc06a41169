"""torch's optimizers, with their step going through ``dslaunch.kernels``.

The types ds_config names and torch implements (``Adam``/``AdamW``, ``SGD``, ``Adagrad``) are
built as these subclasses: identical to torch's classes (same arguments, state, ``state_dict`` and
class names; ``isinstance`` holds) except that ``step`` asks ``kernels.get("torch.<type>",
device)`` for the update: torch's own step (the reference) unless a fused kernel is registered for
the device. A client's optimizer is never swapped for one of these.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from dslaunch import kernels

__all__ = ["Adam", "AdamW", "SGD", "Adagrad"]


class _KernelStep:
    """``step`` = the ``kernel_op`` implementation for the device of the first parameter."""

    kernel_op: ClassVar[str]
    param_groups: list[dict[str, Any]]

    def step(self, closure: Any = None) -> Any:
        device = self.param_groups[0]["params"][0].device
        return kernels.get(self.kernel_op, device)(self, closure)


class Adam(_KernelStep, torch.optim.Adam):
    kernel_op = "torch.adam"


class AdamW(_KernelStep, torch.optim.AdamW):
    kernel_op = "torch.adamw"


class SGD(_KernelStep, torch.optim.SGD):
    kernel_op = "torch.sgd"


class Adagrad(_KernelStep, torch.optim.Adagrad):
    kernel_op = "torch.adagrad"
