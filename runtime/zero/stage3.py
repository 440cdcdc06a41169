"""ZeRO stage 3: parameters, gradients and optimizer state all partitioned across ranks.

Each rank stores only its ``[start, end)`` of every param group's flat vector (``Partitioned``,
``partitioned.ShardGroup``): weights, fp32 master, optimizer state. ``fetcher.ParamFetcher``
gathers a module's parameters just before its forward and releases them after it; backward gathers
what autograd saved again and releases it once its gradient is taken. Gradients take stage 2's path
(``ShardedGradients``: bucketed, reduced into the owning rank's fp32 shard as backward produces
them; every micro step communicates, ``no_sync()`` is refused), except that the gradient shard
and the reduction buffers are freed after each step (``ScopedGradients``), as FSDP2 frees them. The step is every stage's.

Memory per rank: 1/N of stage 0's parameters, gradients and optimizer state, plus the whole
parameters (those of the running modules, prefetched, kept for reuse: at most
``stage3_max_live_parameters`` unless the running modules alone need more), the persistent
parameters and the reduce buckets (measured in ``tests/runtime/zero/test_memory.py``).

Config knobs (``zero_optimization``, DeepSpeed's names and defaults):

- ``stage3_param_persistence_threshold`` (1e5): parameters of at most this many elements stay whole
  on every rank (no gather per forward; re-gathered once after each step).
- ``stage3_prefetch_bucket_size`` (5e7), ``stage3_max_live_parameters`` (1e9),
  ``stage3_max_reuse_distance`` (1e9): the trace of the order parameters are used in, recorded in
  the first iteration, drives prefetch (gathers of the next modules in flight while one computes),
  a bound on the whole parameters and keeping the ones reused soon; see ``prefetch.py``.
- ``zero_quantized_weights``, ``zero_quantized_gradients``, ``zero_hpz_partition_size`` (ZeRO++):
  how gathers and the gradient reduction communicate (int8, int4, a node-local secondary shard);
  see ``zeropp.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dslaunch.runtime.zero import params as zp
from dslaunch.runtime.zero.fetcher import ParamFetcher
from dslaunch.runtime.zero.gradients import gradient_is_whole
from dslaunch.runtime.zero.partitioned import Partitioned
from dslaunch.runtime.zero.persistent import ReleasedPersistent
from dslaunch.runtime.zero.prefetch import FetchLimits
from dslaunch.runtime.zero.sharded_gradients import ScopedGradients
from dslaunch.runtime.zero.specs import CommSettings, GroupSpec, OptimizerFactory, ReduceGroup
from dslaunch.runtime.zero.strategy import ZeroStrategy

__all__ = ["Stage3", "DeepSpeedZeroOptimizer_Stage3"]


class Stage3(ZeroStrategy):
    """Partitioned parameters gathered per module; stage 2's gradients; the shared step.

    collective: construct on all ranks (``module`` is hooked).
    """

    stage = 3
    placement_type = Partitioned
    gradients_type = ScopedGradients

    def __init__(self, groups: list[GroupSpec], make_optimizer: OptimizerFactory, comm: CommSettings,
                 process_group: Any = None, module: torch.nn.Module | None = None,
                 model_parallel_group: Any = None, exchange: Any = None,
                 reduce_groups: Mapping[str, ReduceGroup] | None = None):
        super().__init__(groups, make_optimizer, comm, process_group, module, model_parallel_group, exchange,
                         reduce_groups)
        params = [p for g in self.groups for p in g.params]
        limits = FetchLimits(comm.prefetch_bucket_numel, comm.max_live_parameters, comm.max_reuse_distance)
        self.fetcher = (ParamFetcher(module, params, limits) if module is not None and _gathers(module)
                        else None)
        if module is not None:
            _mark_whole(module)
        for p in params:
            if p.ds_persist:  # whole all along: nothing to shape, nothing to release
                continue
            p.register_hook(_shape_for_grad(p))
            # after the gradient path's hook: the gradient is taken, release
            p.register_post_accumulate_grad_hook(_after_grad(self.fetcher))
        self.persistent = ReleasedPersistent(module, self._remake_persistent)

    def post_backward(self) -> None:
        """Release what backward gathered and did not release (a parameter without gradient)."""
        self.release_gathered()

    def release_gathered(self, persistent: bool = False) -> None:
        """Release every gathered parameter no forward holds; with ``persistent`` the persistent
        ones too, as DeepSpeed's ``engine.empty_partition_cache`` (gathered again before their
        next use: ``persistent.py``)."""
        if self.fetcher is not None:
            self.fetcher.release_idle()
        if persistent:
            self.persistent.release([p for g in self.groups for p in g.params])

    def pre_forward(self) -> None:
        self.persistent.restore()
        super().pre_forward()

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self.persistent.restore()  # the step's publish refreshes them
        return super().step(*args, **kwargs)

    def load_state_dict(self, sd: dict) -> None:
        self.persistent.restore()
        super().load_state_dict(sd)

    def _remake_persistent(self, params: list[torch.nn.Parameter]) -> None:
        """Whole again: a resident group's as views of its shard, the others re-gathered from the
        shards (the placement's publish). collective.

        Raises:
            UsageError: the shards are offloaded (``offload_states``).
        """
        self._require_weights("gathering the persistent parameters")
        released = {id(p) for p in params}
        for g in self.groups:
            g.make_whole([p for p in g.params if id(p) in released])
        for part in self.parts:
            part.placement.publish()


def _gathers(module: torch.nn.Module) -> bool:
    """Whether any of ``module``'s parameters is ever gathered: without one (every group resident,
    ``partitioned.py``, or every parameter persistent) the module is left unhooked, as at stage 0."""
    return any(zp.is_partitioned(p) and not p.ds_persist for p in module.parameters())


def _mark_whole(module: torch.nn.Module) -> None:
    """Give the parameters stage 3 keeps whole on every rank (those not given to the optimizer,
    frozen ones, unless ``zero.Init`` partitioned them) the attributes of DeepSpeed's persistent
    parameters: scripts walking a ZeRO-3 model read ``ds_persist``/``ds_status`` of every parameter.
    No ``ds_id``/``ds_tensor``: they are not ZeRO parameters (``GatheredParameters`` and
    ``is_zero_param`` leave them alone)."""
    for p in module.parameters():
        if not zp.is_partitioned(p):
            p.ds_persist, p.ds_status = True, zp.ZeroParamStatus.AVAILABLE
            p.ds_numel, p.ds_shape = p.numel(), p.shape


def _shape_for_grad(p: torch.nn.Parameter):
    """Before autograd accumulates a gradient into a released parameter (one whose backward did not
    need its value: an embedding, a bias), give it its shape: autograd lays out a gradient it does
    not adopt as is like the parameter. Zero strides: no memory."""
    def hook(grad: torch.Tensor) -> None:
        if p.ds_status is zp.ZeroParamStatus.INFLIGHT:  # prefetched for a later use: settle it
            zp.fetch([p])
        if p.ds_status is zp.ZeroParamStatus.NOT_AVAILABLE:
            p.data = torch.empty((), dtype=p.dtype, device=p.device).expand(p.ds_shape)
    return hook



def _after_grad(fetcher: ParamFetcher | None):
    """Backward is done with the parameter: release it (unless the trace reuses it soon)."""
    def hook(p: torch.nn.Parameter) -> None:
        if not gradient_is_whole(p):  # a tiled computation's next slice uses it again
            return
        if p.ds_status is zp.ZeroParamStatus.NOT_AVAILABLE:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if fetcher is not None:
            fetcher.grad_taken(p)
        else:
            zp.release([p])
    return hook


# DeepSpeed's memory estimator lives at this import path (its formulas and table, unchanged).
from dslaunch.runtime.estimate.deepspeed_formulas import (  # noqa: E402
    count_params_and_largest_layer as model_to_params,
)
from dslaunch.runtime.estimate.deepspeed_formulas import (  # noqa: E402
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)

__all__ += ["estimate_zero3_model_states_mem_needs", "estimate_zero3_model_states_mem_needs_all_live",
            "estimate_zero3_model_states_mem_needs_all_cold", "model_to_params"]


# DeepSpeed's name for its stage-3 optimizer: ``engine.optimizer`` at stage 3
from dslaunch.runtime.zero.optimizer_view import DeepSpeedZeroOptimizer_Stage3  # noqa: E402
