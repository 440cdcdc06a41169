"""Reference implementations that belong to no dslaunch module: torch's own optimizer steps.

The references of dslaunch's own optimizers live next to them (``runtime/optim/adam.py``,
``runtime/optim/lion.py``); ``dispatch.KERNELS`` names them all.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["torch_step"]


def torch_step(optimizer: Any, closure: Any = None) -> Any:
    """One step of ``optimizer`` as the ``torch.optim`` class it derives from computes it.

    The reference of the ``torch.*`` ops: ``optimizer`` is a subclass whose own ``step``
    dispatched here. torch wraps each class's ``step`` once, for its step hooks and the profiler;
    the subclass's step already ran them, so this calls the implementation under that wrapper.
    """
    base = next(c for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim"))
    step = inspect.unwrap(base.step, stop=lambda f: not getattr(f, "hooked", False))
    return step(optimizer, closure)
