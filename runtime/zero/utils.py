"""``deepspeed.runtime.zero.utils``: the ZeRO error class and the predicates DeepSpeed's scripts
and tests import from there."""

from __future__ import annotations

from typing import Any

__all__ = ["ZeRORuntimeException", "is_zero_param", "is_zero_supported_optimizer"]


class ZeRORuntimeException(Exception):
    """DeepSpeed's ZeRO runtime error. dslaunch raises its own errors (one line naming the key);
    none of the cases DeepSpeed raises this for are errors in dslaunch (a checkpoint loads at another
    data-parallel size; a client optimizer under CPU offload runs, ``zero_force_ds_cpu_optimizer``
    is accepted and changes nothing)."""


def is_zero_param(parameter: Any) -> bool:
    """A parameter ZeRO-3 partitioned (it carries DeepSpeed's ``ds_id``)."""
    return hasattr(parameter, "ds_id")


def is_zero_supported_optimizer(optimizer: Any) -> bool:
    """The optimizer's update is element-wise, so ZeRO's flat shards step it exactly (the
    optimizers dslaunch accepts without ``zero_allow_untested_optimizer``)."""
    from dslaunch.runtime.engine_setup import elementwise_optimizers

    return type(optimizer) in elementwise_optimizers()
