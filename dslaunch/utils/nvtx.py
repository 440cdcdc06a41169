"""``deepspeed.utils.nvtx``: ``instrument_w_nvtx``, a decorator that marks every call of a function
as an NVTX range named after it (seen in Nsight Systems); on a machine without CUDA it only calls
the function."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["instrument_w_nvtx"]

F = TypeVar("F", bound=Callable[..., Any])


def instrument_w_nvtx(func: F) -> F:
    """``func`` wrapped in the accelerator's ``range_push(func.__qualname__)`` / ``range_pop()``."""

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        from dslaunch.runtime.accelerator import get_accelerator

        accelerator = get_accelerator()
        accelerator.range_push(func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            accelerator.range_pop()

    return wrapped  # type: ignore[return-value]
