"""What the engine hands a ZeRO strategy and what it gets back: plain frozen records.

``GroupSpec`` (a param group), ``ReduceGroup`` (the ranks a group of them reduces over), ``CommSettings`` (the communication knobs, read from the config
once), ``FlatShards`` (what the optimizer's flat tensors hold) and ``StepResult``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dslaunch.runtime.zero.offload.swap import SwapSettings
from dslaunch.runtime.zero.partition import FlatLayout, GroupLayout, shard_slot

__all__ = ["GroupSpec", "ReduceGroup", "CommSettings", "StepResult", "FlatShards", "OptimizerFactory",
           "group_numel", "largest_piece"]


@dataclass(frozen=True)
class FlatShards:
    """What the optimizer's flat tensors hold, for updates that need per-parameter norms (Lamb)
    or whole matrices (Muon).

    ``layouts[i]``: which original parameters (in flat order) group i's tensor holds, i.e. this
    rank's [start, end) of the group. ``norm_all_reduce``: in-place sum over the data-parallel
    group when ranks hold disjoint shards (stages 1-3), else None. ``group_layouts[i]``: group
    i's shapes, offsets and this rank's range; ``gather(shard, layout)``: the group's whole flat
    vector from every rank's shard (collective; None when each rank holds whole groups).
    """

    layouts: list[FlatLayout]
    norm_all_reduce: Callable[[torch.Tensor], None] | None
    group_layouts: list[GroupLayout] | None = None
    gather: Callable[[torch.Tensor, GroupLayout], torch.Tensor] | None = None


OptimizerFactory = Callable[[list[dict], FlatShards], torch.optim.Optimizer]


@dataclass(frozen=True)
class GroupSpec:
    """One param group as the engine hands it over: trainable params, their names, hparams, and
    ``norm_skipped``: the indices of params whose gradient another rank counts in the global norm
    (``runtime.parallel.mpu.counted_in_norm``: a tied weight's copies above the lowest pipeline
    stage of the tie, a whole parameter on tensor slices other than the first), so that every
    distinct parameter counts once."""

    params: list[torch.nn.Parameter]
    names: list[str]
    hparams: dict
    norm_skipped: tuple[int, ...] = ()
    reduce_group: str = "data"
    """The ranks its gradients are averaged over and its state is sharded over, by name: ``"data"``
    (the data-parallel group) or an expert group's name, ``"ep_size_<N>"`` (that split's
    expert-data group: the ranks holding the same experts). The strategy is handed a
    ``ReduceGroup`` for every name other than ``"data"``."""


def group_numel(params: list[torch.nn.Parameter]) -> int:
    """Elements of a param group's flat vector (a partitioned stage 3 parameter counts whole)."""
    return sum(p.ds_numel if getattr(p, "_dsl_flat", None) is not None else p.numel() for p in params)


def largest_piece(specs: list[GroupSpec], world: int, whole: bool, at_least: int = 1) -> int:
    """Bytes of the largest piece of one of ``specs``' groups that a collective over ``world``
    ranks moves at once: a whole group padded for ``world`` ranks (``whole``: a gradient bucket
    holds at most its group) or one rank's shard of it (the publish, stage 3's gathers), in the
    group's dtype or ``at_least`` bytes an element (gradients may be summed in fp32: 4)."""
    return max((shard_slot(group_numel(g.params), world) * (world if whole else 1)
                * max([at_least] + [p.element_size() for p in g.params]) for g in specs), default=0)


@dataclass(frozen=True)
class ReduceGroup:
    """Where a ``GroupSpec`` of that name reduces and shards: ``process_group`` (its gradients are
    summed there, its state partitioned there) and ``spread_group``: the ranks that hold *different*
    parameters of it (the expert axis: each holds other experts; None: every rank holds the same),
    over which the squared gradient norm sums once more so that every distinct parameter counts.

    The average still divides by the data-parallel size: an expert's gradient summed over its
    expert-data ranks holds the tokens of every data rank routed to it, so dividing by the data
    size is the gradient of the global mean loss (DeepSpeed's ``_reduce_expert_gradients`` and
    ZeRO-1/2 divide the same way)."""

    process_group: Any
    spread_group: Any = None
    norm_owner: bool | None = None
    """None: each parameter counts in the norm where ``GroupSpec.norm_skipped`` says. True / False:
    every rank counts all of its parameters, and the sum over the spread group (every expert once)
    is added to the global norm by the owner only (experts over every rank beside tensor slices:
    tensor peers hold different experts, and the norm counts the sum on tensor rank 0)."""


@dataclass(frozen=True)
class CommSettings:
    """Communication knobs, read from the config once by the engine."""

    reduce_bucket_numel: int = 500_000_000
    allgather_bucket_numel: int = 500_000_000
    overlap_comm: bool = False
    overlap_param_gather: bool = False  # stages 1/2: the publish stays in flight into the next forward
    comm_dtype: torch.dtype | None = None  # None: the gradient dtype (the model's)
    # ``data_types.grad_accum_dtype`` fp32 with a 16-bit model: stage 0/1's whole-gradient buffer is
    # fp32 (None: the model dtype); ``immediate_grad_update``: each 16-bit gradient is added to it in
    # its hook (False: all of them after backward, bf16's ``immediate_grad_update: false``)
    accum_dtype: torch.dtype | None = None
    immediate_grad_update: bool = True
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    average: bool = True  # gradient_allreduce_op "mean"; False: "sum" (no division by the world)
    # Where state lives between uses (``offload_optimizer``/``offload_param`` with device cpu):
    # the fp32 master and optimizer state / stage 3's parameter shards in host memory.
    offload_optimizer: bool = False
    offload_param: bool = False
    pin_memory: bool = False  # page-locked host copies (only where the device is a GPU)
    offload_bucket_numel: int = 1_000_000_000  # sub_group_size: the offloaded step's buckets
    offload_ratio: float = 1.0  # stage 3: the last fraction of each master shard in host memory
    nvme: SwapSettings | None = None  # offload_optimizer device nvme: the state in swap files
    # offload_param device nvme (stage 3): the parameter shards in swap files, except the first
    # param_in_cpu elements of this rank's shards (``max_in_cpu``)
    param_nvme: SwapSettings | None = None
    param_in_cpu: int = 1_000_000_000
    # Stage 3 only (DeepSpeed's defaults): see stage3.py for what each does.
    param_persistence_threshold: int = 100_000
    prefetch_bucket_numel: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    # ZeRO++ (stage 3, zeropp.py): int8 parameter gathers, a node-local secondary shard of this
    # many ranks for backward's gathers (1: none)
    quantized_weights: bool = False
    hpz_partition_size: int = 1
    # ``layout_invariant``: reductions in one fixed order whatever the layout (the norm's pieces in
    # float64, so that their grouping, which the layout decides, cannot change the fp32 result)
    layout_invariant: bool = False
    # ``shared_memory_collectives``: "on" (same-host gloo groups through /dev/shm, ``shm.py``) or "never"
    shared_memory: str = "on"

    def pre_factor(self) -> float:
        """Multiplies gradients before the reduction: 1 / ``gradient_predivide_factor`` with
        ``prescale_gradients``, else 1."""
        return 1.0 / self._predivide()

    def post_factor(self, world_size: int) -> float:
        """Multiplies the reduced sum so that, with ``pre_factor``, it becomes the mean (or stays
        the sum, with ``average`` off)."""
        return self._predivide() / world_size if self.average else self._predivide()

    def _predivide(self) -> float:
        return self.gradient_predivide_factor if self.prescale_gradients else 1.0


@dataclass(frozen=True)
class StepResult:
    """What the engine learns from a boundary step."""

    overflow: bool
    grad_norm: float | None  # unscaled, before clipping (inf/nan on overflow; None: not computed)
