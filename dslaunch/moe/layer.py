"""``deepspeed.moe.layer``: ``MoE`` is importable; building one says dslaunch has no MoE layer."""

from __future__ import annotations

from typing import Any

from dslaunch.errors import DslaunchError

__all__ = ["MoE"]


class MoE:
    """DeepSpeed's Mixture-of-Experts layer: not in dslaunch; constructing one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise DslaunchError("deepspeed.moe.layer.MoE: dslaunch has no Mixture-of-Experts layer; "
                            "build the experts as plain torch modules (expert parallelism is not available)")
