"""What a checkpoint is made of: named parts, each owning its ``state_dict``.

The engine hands ``CheckpointParts`` to ``save_load`` and the checkpoint code never reaches into
the engine. A tag holds these parts, plus each rank's RNG states and the client's state:

- ``module``: the model's weights and buffers (trained params only once, as ``zero``'s masters);
- ``zero``: the ZeRO strategy: this rank's fp32 master weights and optimizer state, resharded on
  load to any world size or stage;
- ``training``: the counters, loss scaler, LR scheduler and data position.

With model parallelism (a pipeline, an mpu) ``placement`` says which part of the model this rank
holds; files are then named by its topology coordinates (``model_parallel``).

``optimizer`` is not saved through this record (its state is ``zero``'s): an asynchronous save makes
its step wait for the snapshot copy. ``io`` is the engine's checkpoint machinery.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from dslaunch.runtime.checkpoint.checkpointer import Checkpointer
    from dslaunch.runtime.checkpoint.model_parallel import Placement
    from dslaunch.runtime.config.sections import CheckpointConfig

__all__ = ["Stateful", "StateFns", "CheckpointParts"]


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class StateFns:
    """A ``Stateful`` made of two functions, for an owner whose methods have other names."""

    state_dict: Callable[[], dict[str, Any]]
    load_state_dict: Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class CheckpointParts:
    """One engine's checkpoint, by part."""

    module: torch.nn.Module
    zero: Any
    """The ``zero.ZeroStrategy``: ``Stateful``, plus ``stage``, ``partitioned`` and ``synchronize``."""
    training: Stateful
    optimizer: Any
    global_steps: int
    config: CheckpointConfig
    io: Checkpointer
    placement: Placement | None = None
    """Where this rank's part of a model-parallel model sits; None: every rank holds the model."""
    ds_config: Mapping[str, Any] = field(default_factory=dict)
    """The engine's config as the user gave it (DeepSpeed's format saves it: ``ds_config``)."""
    gradient_clipping: float = 0.0
    bf16: bool = False
    """bf16 training (DeepSpeed's format names its ZeRO files ``bf16_...``)."""
    bf16_optimizer: bool = False
    """``engine.optimizer`` is DeepSpeed's ``BF16_Optimizer`` (DeepSpeed's format writes its state)."""
