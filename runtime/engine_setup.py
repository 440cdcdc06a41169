"""Assembling the engine's parts once: param groups, optimizer, ZeRO strategy, scheduler, loader.

Kept apart from ``engine.py`` so the engine stays a thin loop. The choices made here:

- param groups come from the client optimizer, else ``model_parameters`` (tensors or group
  dicts), else ``module.parameters()``; frozen params (``requires_grad=False``) are left out;
- the optimizer works on the ZeRO strategy's fp32 master shards, one tensor per group: a config
  optimizer is built by ``optimizers.build_optimizer``; a client ``torch.optim.Optimizer`` is kept
  as the same object with each group's ``params`` re-pointed to the shard (so a client LR
  scheduler bound to it keeps working); a callable gets the shard groups;
- the LR scheduler is a client object, a callable of the optimizer, or ``scheduler`` from the config;
- every rank starts from the first replica's weights: each parameter is broadcast from the first
  rank of the group it is averaged over (DeepSpeed's ``_broadcast_model``), so ranks that built the
  model with different seeds train one model; ``zero.Init`` parameters were broadcast when built;
- without any optimizer the engine only runs forward (``zero/frozen.py``), as DeepSpeed's; at
  stage 3 its parameters stay partitioned and are gathered per module.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.errors import ConfigError, NotInDslaunchError, UntestedOptimizerError
from dslaunch.runtime.config import DeepSpeedConfig
from dslaunch.runtime.moe import expert_group_name
from dslaunch.runtime.parallel import deepspeed_groups
from dslaunch.runtime.parallel.groups import ep_size_of
from dslaunch.runtime.parallel.mpu import counted_in_norm, gradient_reduce_group, tensor_axis
from dslaunch.runtime.parallel.tensor_experts import TensorExperts
from dslaunch.runtime.precision import PrecisionPolicy
from dslaunch.runtime.zero.exchange import GradientExchange, TreeAllReduce, build_exchange
from dslaunch.runtime.zero.leaf_modules import apply_leaf_config
from dslaunch.runtime.zero.offload.swap import SwapSettings
from dslaunch.runtime.zero.registry import strategy_class
from dslaunch.runtime.zero.specs import CommSettings, FlatShards, GroupSpec, ReduceGroup
from dslaunch.runtime.zero.strategy import ZeroStrategy

__all__ = ["EngineParts", "build_components", "broadcast_replicas", "refuse_sequence_conflicts", "sequence_size"]


@dataclass
class EngineParts:
    zero: ZeroStrategy
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    dataloader: Any


def build_components(module: torch.nn.Module, cfg: DeepSpeedConfig, precision: PrecisionPolicy,
                     optimizer: Any, model_parameters: Any, lr_scheduler: Any, training_data: Any,
                     collate_fn: Any, grid: Any) -> EngineParts:
    """Build the strategy (and with it the optimizer), the scheduler and the loader.

    ``grid`` places this rank (``pipe.topology.DataParallelGrid`` or an mpu): the strategy works on
    its gradient-reduce group (data x sequence: ``parallel.mpu.gradient_reduce_group``), the loader
    reads the data-parallel rank's share.

    collective: call on all ranks.
    """
    zero_cfg = cfg.zero_optimization
    apply_leaf_config(module, zero_cfg.leaf_module)  # before stage 3's hooks read the flags
    if optimizer is None and cfg.optimizer is None:  # evaluation or a reference model (DeepSpeed's)
        broadcast_replicas(module, grid, {})
        return _frozen(module, cfg, lr_scheduler, training_data, collate_fn, grid)
    tensor_rank = tensor_axis(grid, "rank")
    groups = _param_groups(module, optimizer, model_parameters, tensor_rank)
    reduce_groups = _expert_groups(groups, grid, cfg, tensor_rank)
    groups = [replace(g, norm_skipped=()) if reduce_groups.get(g.reduce_group, ReduceGroup(None)).norm_owner
              is not None else g for g in groups]  # counted whole, summed over the spread, added by the owner
    broadcast_replicas(module, grid, reduce_groups)
    if optimizer is None:  # Muon: its matrices and the AdamW rest in separate groups
        from dslaunch.runtime.optim.registry import split_groups

        groups = split_groups(cfg.optimizer, groups, _subgroup)
    comm = CommSettings(reduce_bucket_numel=zero_cfg.reduce_bucket_size,
                        allgather_bucket_numel=zero_cfg.allgather_bucket_size,
                        overlap_comm=zero_cfg.overlap_comm, overlap_param_gather=zero_cfg.overlap_param_gather,
                        comm_dtype=precision.comm_dtype, accum_dtype=precision.accum_dtype,
                        immediate_grad_update=not cfg.bf16.enabled or cfg.bf16.immediate_grad_update,
                        prescale_gradients=cfg.prescale_gradients,
                        gradient_predivide_factor=cfg.gradient_predivide_factor,
                        average=cfg.gradient_allreduce_op == "mean",
                        # ratio 0 keeps the whole optimizer on the device: no offload at all
                        offload_optimizer=zero_cfg.offload_optimizer.enabled and zero_cfg.offload_optimizer.ratio > 0,
                        offload_ratio=zero_cfg.offload_optimizer.ratio,
                        offload_param=zero_cfg.offload_param.enabled,
                        pin_memory=zero_cfg.offload_optimizer.pin_memory or zero_cfg.offload_param.pin_memory,
                        offload_bucket_numel=zero_cfg.sub_group_size, nvme=_swap_settings(cfg, "offload_optimizer"),
                        param_nvme=_swap_settings(cfg, "offload_param"),
                        param_in_cpu=zero_cfg.offload_param.max_in_cpu,
                        param_persistence_threshold=zero_cfg.stage3_param_persistence_threshold,
                        prefetch_bucket_numel=zero_cfg.stage3_prefetch_bucket_size,
                        max_live_parameters=zero_cfg.stage3_max_live_parameters,
                        max_reuse_distance=zero_cfg.stage3_max_reuse_distance,
                        quantized_weights=zero_cfg.zero_quantized_weights,
                        hpz_partition_size=zero_cfg.zero_hpz_partition_size,
                        layout_invariant=cfg.layout_invariant.enabled,
                        shared_memory=cfg.shared_memory_collectives)
    model_parallel = grid.get_model_parallel_group() if grid.get_model_parallel_world_size() > 1 else None
    reduce_group = gradient_reduce_group(grid)
    exchange = _exchange(cfg, optimizer, reduce_group, groups)
    zero = strategy_class(zero_cfg.stage)(groups, _optimizer_factory(cfg, optimizer, exchange, groups), comm,
                                          process_group=reduce_group, module=module,
                                          model_parallel_group=model_parallel, exchange=exchange,
                                          reduce_groups=reduce_groups)
    return EngineParts(zero, zero.optimizer, _scheduler(cfg, lr_scheduler, zero.optimizer),
                       _dataloader(cfg, training_data, collate_fn, grid))


def broadcast_replicas(module: torch.nn.Module, grid: Any, experts: dict[str, ReduceGroup]) -> None:
    """Give every rank the first replica's parameters, before the strategy shards them: a dense
    parameter from the first rank of the gradient-reduce group, an expert parameter from the first
    of its expert-data group (DeepSpeed's ``_broadcast_model``). Left as they are: ``zero.Init``
    parameters (broadcast when built) and expert parameters of a group no param group trains.

    collective: call on all ranks of the job.
    """
    from dslaunch.runtime.zero.params import is_partitioned

    if not dist.is_initialized():
        return
    dense = gradient_reduce_group(grid)
    for param in module.parameters():
        name = expert_group_name(param)
        if is_partitioned(param) or (name is not None and name not in experts):
            continue
        group = dense if name is None else experts[name].process_group
        if dist.get_world_size(group) == 1:
            continue
        source = dist.get_process_group_ranks(group)[0] if group is not None else 0
        dist.broadcast(param.data, source, group=group)


def _expert_groups(groups: list[GroupSpec], grid: Any, cfg: DeepSpeedConfig,
                   tensor_rank: int = 0) -> dict[str, ReduceGroup]:
    """The expert-data group (reduce, shard) and expert group (the norm's spread) of every expert
    group name the param groups use, from the grid's expert split of that size (made here if no
    module made it: collective, every rank the same names in the same order). Beside tensor slices
    with experts over every rank (``TensorExperts``, not sliced) an expert group spans tensor peers
    that hold different experts: every rank counts its experts, tensor rank 0 adds their sum.

    Raises:
        ConfigError: expert parameters with an mpu that is not a dslaunch grid, or with an optimizer
            that reads the flat shards as one data-parallel group (Lamb, Muon, the 1-bit ones).
    """
    names = list(dict.fromkeys(g.reduce_group for g in groups if g.reduce_group != "data"))
    if not names:
        return {}
    home = deepspeed_groups.expert_home(grid)
    if home is None:
        raise ConfigError(f"expert parameters (group_name {names[0]}) need the ranks' layout: the mpu "
                          f"{type(grid).__name__} is not a deepspeed PipelineParallelGrid; pass one (or no mpu)")
    if cfg.optimizer is not None:
        from dslaunch.runtime.optim.registry import sees_flat_shards

        if sees_flat_shards(cfg.optimizer):
            raise ConfigError(f"optimizer {cfg.optimizer.name!r} reads its flat shards over the data-parallel "
                              f"group, and expert parameters ({names[0]}) shard over their expert-data group; "
                              "use an element-wise optimizer (Adam, AdamW, SGD, Lion) with experts",
                              key="optimizer.type")
    out = {}
    for name in names:
        split = home.experts(ep_size_of(name), cfg.use_data_before_expert_parallelism)
        owner = tensor_rank == 0 if isinstance(home, TensorExperts) and not home.sliced(ep_size_of(name)) else None
        out[name] = ReduceGroup(split.group("expert_data"), split.group("expert"), owner)
    return out


def _exchange(cfg: DeepSpeedConfig, client: Any, process_group: Any, groups: list[GroupSpec]) -> GradientExchange:
    """The strategy's gradient exchange: compressed for a config's 1-bit optimizer, else flat or
    hierarchical (``hierarchical_allreduce``). collective: all ranks."""
    from dslaunch.runtime.optim.registry import is_compressed

    compressed = client is None and is_compressed(cfg.optimizer)
    if cfg.layout_invariant.enabled:  # what it cannot keep invariant was refused at load (config/layout_invariant.py)
        return TreeAllReduce(process_group)
    if cfg.zero_optimization.zero_quantized_gradients:
        from dslaunch.runtime.zero.zeropp import QuantizedReduceScatter

        return QuantizedReduceScatter.build(process_group)
    return build_exchange(compressed, cfg.hierarchical_allreduce, process_group, cfg.shared_memory_collectives,
                          groups)


def _swap_settings(cfg: DeepSpeedConfig, section: str) -> SwapSettings | None:
    off = getattr(cfg.zero_optimization, section)
    if off.device != "nvme":
        return None
    return SwapSettings(off.nvme_path, off.buffer_count, off.buffer_size, off.pipeline_read, off.pipeline_write,
                        cfg.aio.block_size, cfg.aio.queue_depth, section,
                        "optimizer state" if section == "offload_optimizer" else "parameter shard")


def _frozen(module: torch.nn.Module, cfg: DeepSpeedConfig, lr_scheduler: Any, training_data: Any,
            collate_fn: Any, grid: Any) -> EngineParts:
    from dslaunch.runtime.zero.frozen import Frozen

    if lr_scheduler is not None or cfg.scheduler is not None:
        raise ConfigError("a scheduler without an optimizer: add an 'optimizer' section or pass "
                          "optimizer= to initialize(), or drop the scheduler", key="scheduler")
    zero_cfg = cfg.zero_optimization
    frozen = Frozen(zero_cfg.stage, module, persistence_threshold=zero_cfg.stage3_param_persistence_threshold,
                    offload_param=zero_cfg.offload_param.enabled, process_group=gradient_reduce_group(grid))
    return EngineParts(frozen, None, None,  # type: ignore[arg-type]
                       _dataloader(cfg, training_data, collate_fn, grid))


def _param_groups(module: torch.nn.Module, optimizer: Any, model_parameters: Any,
                  tensor_rank: int = 0) -> list[GroupSpec]:
    names = {id(p): n for n, p in module.named_parameters()}
    if isinstance(optimizer, torch.optim.Optimizer):
        raw = optimizer.param_groups
    elif model_parameters is not None:
        raw = list(model_parameters)
        if raw and not isinstance(raw[0], dict):
            raw = [{"params": raw}]
    else:
        raw = [{"params": list(module.parameters())}]
    groups = []
    for i, g in enumerate(raw):
        params = [p for p in g["params"] if p.requires_grad]
        missing = [p for p in params if id(p) not in names]
        if missing:
            raise ConfigError(f"param group {i} holds {len(missing)} tensor(s) that are not parameters "
                              "of the model passed to initialize()")
        hparams = {k: v for k, v in g.items() if k != "params"}
        # Expert parameters (allreduce False) reduce over their own group: a group of their own each.
        by_reduce = {name: [p for p in params if (expert_group_name(p) or "data") == name]
                     for name in dict.fromkeys(expert_group_name(p) or "data" for p in params)}
        for reduce_group, mine in by_reduce.items():
            skipped = tuple(j for j, p in enumerate(mine) if not counted_in_norm(p, tensor_rank))
            extra = {} if reduce_group == "data" else {"name": reduce_group, "moe": True}
            groups.append(GroupSpec(mine, [names[id(p)] for p in mine], {**hparams, **extra}, skipped,
                                    reduce_group))
    if not groups:
        raise ConfigError("the model has no trainable parameters (requires_grad=True)")
    return groups


def _subgroup(group: GroupSpec, indices: list[int], use_muon: bool) -> GroupSpec:
    return GroupSpec([group.params[i] for i in indices], [group.names[i] for i in indices],
                     {**group.hparams, "use_muon": use_muon},
                     tuple(k for k, i in enumerate(indices) if i in group.norm_skipped), group.reduce_group)


def _client_wins(section: Any, key: str) -> None:
    """DeepSpeed silently prefers a client optimizer/scheduler over the config's: say so on rank 0."""
    if section is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"dslaunch: warning: the config's '{key}' section is ignored: initialize() was given "
              f"a client {key} (DeepSpeed does the same)", file=sys.stderr, flush=True)


def elementwise_optimizers() -> tuple[type, ...]:
    """Client optimizer types whose update is element-wise: on one flat tensor per param group they
    compute exactly what they compute per parameter."""
    from dslaunch.kernels.cpu.optimizers import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion
    from dslaunch.kernels.fused_adam import FusedAdam
    from dslaunch.runtime.optim.adam import Adam
    from dslaunch.runtime.optim.lion import Lion

    o = torch.optim
    # DeepSpeed's own optimizer classes too: scripts pass them as client optimizers (DeepSpeed-Chat:
    # DeepSpeedCPUAdam with offload, else FusedAdam), and DeepSpeed's ZeRO supports them
    return (o.Adam, o.AdamW, o.SGD, o.Adagrad, o.RMSprop, o.Adadelta, o.Adamax, o.NAdam, o.RAdam,
            o.Rprop, o.ASGD, Adam, Lion, FusedAdam, DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion)


def _checked_client(opt: Any, cfg: DeepSpeedConfig) -> Any:
    """DeepSpeed refuses client optimizers it has not tested with ZeRO unless
    ``zero_allow_untested_optimizer``. dslaunch flattens every param group at every stage, so an
    optimizer with per-tensor statistics (Adafactor, LAMB, Shampoo, Muon, ...) would compute
    something else than per parameter: the same switch guards it, at stage 0 too."""
    if isinstance(opt, torch.optim.SparseAdam):  # it would fail at the first step, switch or not
        raise NotInDslaunchError("client optimizer torch.optim.SparseAdam steps only on sparse gradients, and "
                                 "dslaunch keeps every gradient dense (an nn.Embedding(sparse=True)'s is "
                                 "scattered into the flat buffer); use torch.optim.Adam, which also updates "
                                 "the rows that got no gradient this step (SparseAdam leaves them)")
    allowed = elementwise_optimizers()
    if type(opt) in allowed or cfg.zero_allow_untested_optimizer:
        return opt
    names = ", ".join(sorted({t.__name__ for t in allowed}))
    raise UntestedOptimizerError(f"client optimizer {type(opt).__module__}.{type(opt).__name__} is untested "
                                 "with dslaunch's ZeRO: it runs on one flat fp32 tensor per param group (at "
                                 f"every stage), which is exact only for element-wise optimizers ({names}); "
                                 "set \"zero_allow_untested_optimizer\": true to run it anyway",
                                 key="zero_allow_untested_optimizer")


def _origins(client_groups: list[dict], specs: list[GroupSpec]) -> list[dict]:
    """The client param group each spec came from (by its first parameter)."""
    home = {id(p): g for g in client_groups for p in g["params"]}
    return [home[id(spec.params[0])] for spec in specs]


def _optimizer_factory(cfg: DeepSpeedConfig, client: Any, exchange: GradientExchange,
                       specs: list[GroupSpec]) -> Any:
    if isinstance(client, torch.optim.Optimizer) or callable(client):
        _client_wins(cfg.optimizer, "optimizer")
    if isinstance(client, torch.optim.Optimizer):
        _checked_client(client, cfg)  # before the client's param groups are touched

        def repoint(groups: list[dict], flat: FlatShards) -> torch.optim.Optimizer:
            # Same object, same hyperparameters; only the tensors change to the flat shards. A group
            # holding dense and expert parameters became several: each a copy of the client's.
            kept = [g for g in client.param_groups if any(p.requires_grad for p in g["params"])]
            if len(kept) != len(groups):
                kept = [{**g, **theirs} for g, theirs in zip(_origins(client.param_groups, specs), groups,
                                                             strict=True)]
            for mine, theirs in zip(kept, groups, strict=True):
                mine["params"] = theirs["params"]
            client.param_groups[:] = kept
            client.state.clear()
            return client
        return repoint
    if callable(client):
        # DeepSpeed's contract: called with the groups only
        return lambda groups, flat: _checked_client(client(groups), cfg)
    if cfg.optimizer is not None:
        from dslaunch.runtime.optim.registry import build_optimizer

        # The layouts let Lamb compute one trust ratio per original parameter, not per flat group.
        return lambda groups, flat: build_optimizer(cfg.optimizer, groups, flat_layouts=flat.layouts,
                                                    norm_all_reduce=flat.norm_all_reduce, exchange=exchange,
                                                    group_layouts=flat.group_layouts, gather=flat.gather)
    raise AssertionError("build_components builds no optimizer factory without an optimizer")


def _scheduler(cfg: DeepSpeedConfig, client: Any, optimizer: torch.optim.Optimizer) -> Any:
    if client is not None:
        _client_wins(cfg.scheduler, "scheduler")
        return client if hasattr(client, "step") else client(optimizer)
    if cfg.scheduler is None:
        return None
    from dslaunch.runtime.lr_schedules import build_lr_scheduler

    return build_lr_scheduler(cfg.scheduler, optimizer)


def _dataloader(cfg: DeepSpeedConfig, data: Any, collate_fn: Any, grid: Any) -> Any:
    return None if data is None else data_loader(cfg, data, grid, collate_fn=collate_fn)


def data_loader(cfg: DeepSpeedConfig, data: Any, grid: Any, batch_size: int | None = None, collate_fn: Any = None,
                num_workers: int = 0, pin_memory: bool = False, sampler: Any = None, shuffle: bool = True) -> Any:
    """The data-parallel rank's share of ``data`` in batches of ``batch_size`` (default: the
    config's micro batch), reshuffled each epoch unless ``shuffle`` is False: the parts of one
    replica (pipeline stages, tensor slices) read the same samples. With a ``sampler`` (DeepSpeed's
    ``data_sampler``), torch's loader over it instead."""
    from dslaunch.runtime.dataloader import DeepSpeedDataLoader

    batch_size = batch_size or cfg.train_micro_batch_size_per_gpu
    if sampler is None and cfg.data_efficiency.curriculum_enabled:
        return _curriculum_loader(cfg, data, grid, batch_size, collate_fn, pin_memory)
    if sampler is not None:
        return torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                                           num_workers=num_workers, pin_memory=pin_memory,
                                           drop_last=cfg.dataloader_drop_last)
    return DeepSpeedDataLoader(data, batch_size, pin_memory, -1, None, collate_fn=collate_fn,
                               num_local_io_workers=num_workers, data_parallel_world_size=grid.get_data_parallel_world_size(),
                               data_parallel_rank=grid.get_data_parallel_rank(),
                               dataloader_drop_last=cfg.dataloader_drop_last, shuffle=shuffle,
                               blocked=cfg.layout_invariant.enabled)


def _curriculum_loader(cfg: DeepSpeedConfig, data: Any, grid: Any, batch_size: int, collate_fn: Any,
                       pin_memory: bool) -> Any:
    """DeepSpeed's loader over its curriculum sampler (``data_efficiency``): its own worker count."""
    from dslaunch.runtime.data_pipeline.data_sampling.curriculum_loader import (
        CurriculumDataLoader,
        curriculum_loader_config,
    )

    sampling = cfg.data_efficiency.data_sampling
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    settings = curriculum_loader_config(cfg.data_efficiency, grid.get_data_parallel_group(),
                                        cfg.gradient_accumulation_steps, rank, sampling.num_workers)
    return CurriculumDataLoader(data, batch_size, pin_memory or sampling.pin_memory, -1, None, collate_fn=collate_fn,
                                data_parallel_world_size=grid.get_data_parallel_world_size(),
                                data_parallel_rank=grid.get_data_parallel_rank(),
                                dataloader_drop_last=cfg.dataloader_drop_last, deepspeed_dataloader_config=settings)


def sequence_size(mpu: Any) -> int:
    """The sequence-parallel degree an mpu (or grid) reports; 1 without one."""
    return getattr(mpu, "get_sequence_parallel_world_size", lambda: 1)() if mpu is not None else 1


def refuse_sequence_conflicts(config: DeepSpeedConfig, mpu: Any) -> None:
    """Refuse what sequence parallelism cannot train, on every rank alike and before any collective."""
    size = sequence_size(mpu) if mpu is not None else config.sequence_parallel_size
    if config.sequence_parallel_size not in (1, size):  # an mpu that disagrees
        raise ConfigError(f"{config.sequence_parallel_size}, but the mpu given to initialize() splits each "
                          f"sequence over {size} rank(s); make them agree or remove the key",
                          key="sequence_parallel_size")
    if size > 1 and config.gradient_allreduce_op == "sum":
        # every sequence rank holds N times its part (sequence_parallel/loss.py): a sum over data x
        # sequence would be N times the samples' sum
        raise ConfigError("\"sum\" with sequence parallelism is not supported: use \"mean\" (scale the loss "
                          "for a sum)", key="gradient_allreduce_op")
    if size > 1 and config.tensor_parallel.size > 1:
        raise ConfigError("AutoTP training with sequence parallelism is not implemented yet: use one of "
                          "tensor_parallel.autotp_size and sequence_parallel_size", key="tensor_parallel.autotp_size")
