"""The placement of an engine built without an optimizer: evaluation and reference models.

DeepSpeed lets ``initialize(model=..., config=...)`` run with no optimizer anywhere (no client
optimizer, no ``optimizer`` section): the engine then only places the model (device, dtype) and
runs its forward, e.g. Hugging Face evaluation or an RLHF reference model (TRL, OpenRLHF), frozen
parameters included. ``Frozen`` answers the engine's strategy calls for that case: no flat
buffers, no gradient reduction, and ``backward``/``step`` are errors (DeepSpeed asserts there).

At stage 3 the parameters stay partitioned, as DeepSpeed's ``DeepSpeedZeRoOffload`` (what its
engine builds at stage 3 without an optimizer) keeps them: parameters built under ``zero.Init``
stay as they are, the others are partitioned at ``initialize`` (rank 0's values, as
``zero.Init(module=...)``), parameters of at most ``stage3_param_persistence_threshold`` elements
are kept whole on every rank, and stage 3's ``ParamFetcher`` gathers each module's parameters for
its forward and releases them after it. Stages 0-2 keep the module whole (DeepSpeed refuses
stages 1/2 without an optimizer).

Checkpoints hold the module weights only (``state_dict`` has no param groups): the module file
has every parameter, gathered whole at stage 3.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dslaunch.errors import UsageError
from dslaunch.runtime.zero import params as zp
from dslaunch.runtime.zero.persistent import ReleasedPersistent

__all__ = ["Frozen"]

_NO_OPTIMIZER = ("this engine was built without an optimizer (no optimizer= and no 'optimizer' "
                 "section), so it only runs forward")


class Frozen:
    """The strategy calls of ``ZeroStrategy`` for an engine that never steps.

    Args:
        stage: the configured ZeRO stage.
        module: the model; at stage 3 it is partitioned and hooked (collective).
        persistence_threshold: stage 3: parameters of at most this many elements stay whole.
        offload_param: stage 3: the shards of parameters partitioned here live in host memory.
        process_group: stage 3: the ranks the parameters are partitioned over (None: all), the
            data-parallel group of an engine whose replicas hold different parts (AutoTP's slices).

    collective: construct on all ranks (stage 3 partitions the module).
    """

    partitioned = False  # no master or optimizer shards: rank 0 alone writes the (empty) ZeRO file
    optimizer = None
    backward_pending = False  # no gradient hooks: nothing to complete

    def __init__(self, stage: int, module: torch.nn.Module | None = None, persistence_threshold: int = 0,
                 offload_param: bool = False, process_group: Any = None):
        self.stage = stage
        self.world_size = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.fetcher = self.persistent = None
        self.module = module
        if stage == 3 and module is not None:
            self.fetcher = _partition_for_forward(module, persistence_threshold, offload_param, process_group)
            self.persistent = ReleasedPersistent(module, zp.fetch)

    def synchronize(self) -> None:
        """Nothing is ever in flight (stage 3's gathers complete before the forward runs)."""

    def pre_forward(self) -> None:
        """The module's own hooks gather what stage 3 partitioned: ``engine.module(...)`` works too
        (and the persistent parameters an ``empty_partition_cache`` released: ``persistent.py``)."""

    def release_gathered(self, persistent: bool = False) -> None:
        """Stage 3: release every gathered parameter no forward holds (``engine.empty_partition_cache``
        of an engine that only runs forward, as DeepSpeed's), with ``persistent`` the persistent ones
        too (gathered again before their next use, ``persistent.py``); below it nothing is gathered."""
        if self.fetcher is not None:
            self.fetcher.release_idle()
        if persistent and self.persistent is not None:
            self.persistent.release(list(self.module.parameters()))

    def begin_micro_step(self, boundary: bool, sync: bool = True) -> None:
        raise UsageError(f"engine.backward(): {_NO_OPTIMIZER}; pass an optimizer to initialize() to train")

    def post_backward(self) -> None:
        """Never reached: ``begin_micro_step`` refused the backward."""

    end_backward = post_backward

    def hold_reductions(self) -> None:
        """No gradients to hold (``begin_micro_step`` refuses a backward)."""

    def end_window(self, reduce: bool = True) -> None:
        """No gradients to reduce."""

    def zero_grad(self) -> None:
        """No gradients are kept."""

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError(f"engine.step(): {_NO_OPTIMIZER}; pass an optimizer to initialize() to train")

    def sync_master_from_model(self) -> None:
        """There is no fp32 master copy: the module's weights are the only ones."""

    def state_dict(self) -> dict:
        """The checkpoint contract's format with no param groups: every weight is the module's."""
        return {"stage": self.stage, "world_size": self.world_size, "rank": self.rank, "groups": []}

    def load_state_dict(self, sd: dict) -> None:
        """Nothing to restore (the checkpoint code checked the saved groups against ``state_dict``)."""


def _partition_for_forward(module: torch.nn.Module, persistence_threshold: int, offload_param: bool,
                           process_group: Any) -> Any:
    """Partition what ``zero.Init`` did not, keep small parameters whole, hook every module."""
    from dslaunch.runtime.zero.fetcher import ParamFetcher
    from dslaunch.runtime.zero.partition_parameters import Init

    # skips partitioned ones
    Init(module=module, data_parallel_group=process_group, remote_device="cpu" if offload_param else None)
    params = list(module.parameters())
    small = [p for p in params if not p.ds_persist and p.ds_numel <= persistence_threshold]
    zp.fetch(small)  # collective, the same list on every rank
    for p in small:
        zp.attach(p, p._dsl_flat, p._dsl_offset, p.ds_shape, persist=True)
    return ParamFetcher(module, params)
