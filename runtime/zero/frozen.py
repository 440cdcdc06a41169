"""The placement of an engine built without an optimizer: evaluation and reference models.

DeepSpeed lets ``initialize(model=..., config=...)`` run with no optimizer anywhere (no client
optimizer, no ``optimizer`` section): the engine then only places the model (device, dtype) and
runs its forward, e.g. Hugging Face evaluation or an RLHF reference model, frozen parameters
included. ``Frozen`` answers the engine's strategy calls for that case: no flat buffers, no
gradient reduction, and ``backward``/``step`` are errors (DeepSpeed asserts there).

Limitations: such an engine has no checkpoint of its own (save the module's ``state_dict()``).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dslaunch.errors import UsageError

__all__ = ["Frozen"]

_NO_OPTIMIZER = ("this engine was built without an optimizer (no optimizer= and no 'optimizer' "
                 "section), so it only runs forward")


class Frozen:
    """The strategy calls of ``ZeroStrategy`` for an engine that never steps."""

    partitioned = False
    optimizer = None

    def __init__(self, stage: int):
        self.stage = stage
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def synchronize(self) -> None:
        """Nothing is ever in flight."""

    def pre_forward(self) -> None:
        """The parameters are the module's own: always usable."""

    def begin_micro_step(self, boundary: bool, sync: bool = True) -> None:
        raise UsageError(f"engine.backward(): {_NO_OPTIMIZER}; pass an optimizer to initialize() to train")

    def post_backward(self) -> None:
        """Never reached: ``begin_micro_step`` refused the backward."""

    end_backward = post_backward

    def zero_grad(self) -> None:
        """No gradients are kept."""

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError(f"engine.step(): {_NO_OPTIMIZER}; pass an optimizer to initialize() to train")

    def sync_master_from_model(self) -> None:
        """There is no fp32 master copy: the module's weights are the only ones."""

    def state_dict(self) -> dict:
        raise UsageError(f"engine.save_checkpoint(): {_NO_OPTIMIZER}; save engine.module.state_dict() instead")

    load_state_dict = state_dict
