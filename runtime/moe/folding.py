"""AutoEP folded with AutoTP: the rank tables and the config rules (DeepSpeed 0.19.x's
``deepspeed.module_inject.auto_ep_folding`` and ``auto_ep_config.validate_autoep_config``).

DeepSpeed "folds" the expert-parallel groups into the tensor x data mesh of a pipeline stage
instead of carving them out of the data axis alone: with ``tp`` tensor slices and ``ep`` expert
ranks over a stage of ``S`` ranks,

- tensor groups are ``tp`` neighbouring ranks, dense data groups every ``tp``-th rank (one per
  tensor lane);
- expert groups are ``ep`` neighbouring ranks (they may span tensor lanes), expert-data groups
  the ranks at the same position of every expert group (``S / ep`` of them, ``edp``).

This module is pure arithmetic on sizes (no process group, torch-free), so a launcher or a test
can check a layout before any rank starts. dslaunch's engine does not train folded jobs yet:
``expert_parallel`` with ``tensor_parallel.autotp_size`` > 1 is refused at ``initialize``
(``config/expert_parallel.py``); these tables are what a folded run would use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ParallelFoldingSpec", "FoldingGroupTables", "FoldingGroupHandles", "build_folding_spec",
           "expected_folding_group_tables", "local_folding_ranks", "assert_group_matches_spec",
           "validate_folding_global", "validate_autoep_config"]

Table = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ParallelFoldingSpec:
    """The sizes of one folded layout (``stage_size`` = world / pp; ``dp`` = stage / tp;
    ``edp`` = stage / (ep * etp)). ``mp_mode``: "tp" (tensor slices) or "sp" (sequence)."""

    world_size: int
    pp_size: int
    stage_size: int
    tp_size: int
    dp_size: int
    ep_size: int
    etp_size: int
    edp_size: int
    mp_mode: str = "tp"


@dataclass(frozen=True)
class FoldingGroupTables:
    """Every group's rank tuple, per kind, over the whole world (stage by stage)."""

    tp_groups: Table
    dense_dp_groups: Table
    ep_groups: Table
    edp_groups: Table


@dataclass(frozen=True)
class FoldingGroupHandles:
    """One rank's process groups of a folded layout and their rank tuples (a container only)."""

    spec: ParallelFoldingSpec
    tp_group: Any
    dense_dp_group: Any
    ep_group: Any
    edp_group: Any
    ep_group_name: str
    tp_ranks: tuple[int, ...]
    dense_dp_ranks: tuple[int, ...]
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def build_folding_spec(*, world_size: int, pp_size: int, tp_size: int, ep_size: int, etp_size: int = 1,
                       mp_mode: str = "tp") -> ParallelFoldingSpec:
    """The folded sizes of a stage.

    Raises:
        ValueError: a size below 1, or one that does not divide what it must (the message names the
            config key and the values that would divide).
    """
    sizes = {"world_size": world_size, "pp_size": pp_size, "tensor_parallel.autotp_size": tp_size,
             "expert_parallel.autoep_size": ep_size, "expert_parallel.expert_tensor_parallel_size": etp_size}
    for key, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key}: expected an integer >= 1, got {value!r}")
    if world_size % pp_size:
        raise ValueError(f"pp_size={pp_size} must divide world_size={world_size}; "
                         f"Valid pp_size values: {_divisors(world_size)}")
    stage = world_size // pp_size
    where = f"the stage size (world_size={world_size} / pp_size={pp_size} = {stage})"
    if stage % tp_size:
        raise ValueError(f"tensor_parallel.autotp_size={tp_size} must divide {where}, or the data-parallel size "
                         f"is not whole; Valid autotp_size values: {_divisors(stage)}")
    width = ep_size * etp_size
    if stage % width:
        raise ValueError(f"expert_parallel.autoep_size * expert_parallel.expert_tensor_parallel_size "
                         f"({ep_size} * {etp_size} = {width}) must divide {where}, or the expert-data size is not "
                         f"whole; Valid expert-width values: {_divisors(stage)}")
    return ParallelFoldingSpec(world_size=world_size, pp_size=pp_size, stage_size=stage, tp_size=tp_size,
                               dp_size=stage // tp_size, ep_size=ep_size, etp_size=etp_size,
                               edp_size=stage // width, mp_mode=mp_mode)


def expected_folding_group_tables(spec: ParallelFoldingSpec) -> FoldingGroupTables:
    """The rank tuples of every tensor, dense-data, expert and expert-data group (no process group)."""
    tp: list[tuple[int, ...]] = []
    dense: list[tuple[int, ...]] = []
    ep: list[tuple[int, ...]] = []
    edp: list[tuple[int, ...]] = []
    for first in range(0, spec.world_size, spec.stage_size):
        stage = tuple(range(first, first + spec.stage_size))
        tp += [stage[i:i + spec.tp_size] for i in range(0, spec.stage_size, spec.tp_size)]
        dense += [stage[lane::spec.tp_size] for lane in range(spec.tp_size)]
        experts = [stage[i:i + spec.ep_size] for i in range(0, spec.stage_size, spec.ep_size)]
        ep += experts
        edp += [tuple(group[pos] for group in experts) for pos in range(spec.ep_size)]
    return FoldingGroupTables(tuple(tp), tuple(dense), tuple(ep), tuple(edp))


def local_folding_ranks(global_rank: int, spec: ParallelFoldingSpec) -> dict[str, tuple[int, ...]]:
    """``global_rank``'s group of each kind: keys ``tp``, ``dense_dp``, ``ep``, ``edp``."""
    tables = expected_folding_group_tables(spec)
    kinds = {"tp": tables.tp_groups, "dense_dp": tables.dense_dp_groups, "ep": tables.ep_groups,
             "edp": tables.edp_groups}
    return {kind: next(g for g in table if global_rank in g) for kind, table in kinds.items()}


def assert_group_matches_spec(existing_rank_lists: Any, spec: ParallelFoldingSpec, *,
                              group_kind: str = "ep_edp") -> None:
    """Check expert / expert-data rank lists made earlier (a ``(ep, edp)`` pair or a dict with those
    keys) against the tables of ``spec``: a name like ``ep_size_4`` made for another layout must not
    be reused.

    Raises:
        RuntimeError: a list that is not one of the spec's groups (names it and the spec).
    """
    if isinstance(existing_rank_lists, dict):
        observed = (existing_rank_lists.get("ep", []), existing_rank_lists.get("edp", []))
    else:
        observed = tuple(existing_rank_lists)
    tables = expected_folding_group_tables(spec)
    for kind, lists, expected in (("expert-parallel", observed[0], tables.ep_groups),
                                  ("expert-data-parallel", observed[1], tables.edp_groups)):
        for ranks in lists:
            group = tuple(int(r) for r in ranks)
            if group not in expected:
                raise RuntimeError(f"the existing {kind} group {group} does not match folding spec {spec}")


def _mpu_size(mpu: Any, *names: str) -> int | None:
    for name in names:
        get = getattr(mpu, name, None)
        if callable(get):
            return get()
    return None


def validate_folding_global(spec: ParallelFoldingSpec, *, zero_stage: int = 0, sp_size: int = 1,
                            deepcompile_enabled: bool = False, use_data_before_expert_parallel: bool = False,
                            mpu: Any = None, autoep_enabled: bool = True, tp_preset: str | None = None,
                            ep_preset: str | None = None, zero_offload_optimizer: bool = False,
                            zero_offload_param: bool = False) -> None:
    """The rules a folded layout must meet before any group exists (DeepSpeed's, same order).

    Raises:
        ValueError: the first rule broken, naming the keys involved.
    """
    if not autoep_enabled:
        return
    folded = spec.tp_size > 1
    if deepcompile_enabled and folded:
        raise ValueError("DeepCompile cannot run AutoEP+AutoTP folding; set compile.deepcompile to false, "
                         "or tensor_parallel.autotp_size to 1")
    if folded and spec.pp_size > 1:
        raise ValueError(f"AutoEP+AutoTP folding works with pp_size=1 only (got pp_size={spec.pp_size})")
    if folded and sp_size > 1:
        raise ValueError(f"tensor_parallel.autotp_size={spec.tp_size} and sequence parallelism "
                         f"(sp_size={sp_size}) are mutually exclusive under AutoEP folding")
    if spec.etp_size != 1:
        raise ValueError(f"expert_parallel.expert_tensor_parallel_size={spec.etp_size} is reserved (slicing "
                         "each expert over tensor ranks is not implemented); set it to 1")
    if tp_preset is not None and ep_preset is not None and tp_preset != ep_preset:
        raise ValueError(f"tensor_parallel.preset_model={tp_preset!r} and expert_parallel.preset_model="
                         f"{ep_preset!r} must match when both are set")
    if folded and spec.ep_size == 1:
        raise ValueError("AutoEP+AutoTP folding needs expert_parallel.autoep_size > 1: with every expert local, "
                         "each tensor lane would count the routed tokens' gradients again")
    if folded and use_data_before_expert_parallel:
        raise ValueError("use_data_before_expert_parallel_ cannot be combined with AutoEP+AutoTP folding; "
                         "turn it off")
    if folded and (zero_offload_optimizer or zero_offload_param):
        raise ValueError("ZeRO offload (optimizer or parameters) with AutoEP+AutoTP folding is not supported; "
                         "turn offload off")
    mpu_tp = _mpu_size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    if mpu_tp not in (None, 1, spec.tp_size):
        raise ValueError(f"the mpu tensor/model parallel world size ({mpu_tp}) differs from "
                         f"tensor_parallel.autotp_size={spec.tp_size}")
    mpu_pp = _mpu_size(mpu, "get_pipeline_model_parallel_world_size", "get_pipeline_parallel_world_size")
    if mpu_pp not in (None, spec.pp_size):
        raise ValueError(f"the mpu pipeline parallel world size ({mpu_pp}) differs from pp_size={spec.pp_size}")


def validate_autoep_config(config: Any, world_size: int, pp_size: int, tp_size: int, sp_size: int, *,
                           zero_stage: int = 0, deepcompile_enabled: bool = False,
                           tp_preset_model: str | None = None, use_data_before_expert_parallel: bool = False,
                           mpu: Any = None, zero_offload_optimizer: bool = False,
                           zero_offload_param: bool = False) -> None:
    """DeepSpeed's check of an ``expert_parallel`` block against the job's sizes: the folded
    layout's rules (``validate_folding_global``) for an enabled block. The block's own keys were
    checked when it was parsed (``parse_autoep_config``).

    Raises:
        ValueError: the first rule broken.
    """
    if not config.enabled:
        return
    spec = build_folding_spec(world_size=world_size, pp_size=pp_size, tp_size=max(tp_size, 1),
                              ep_size=config.autoep_size, etp_size=config.expert_tensor_parallel_size,
                              mp_mode="tp" if tp_size > 1 else "sp")
    validate_folding_global(spec, zero_stage=zero_stage, sp_size=sp_size, deepcompile_enabled=deepcompile_enabled,
                            use_data_before_expert_parallel=use_data_before_expert_parallel, mpu=mpu,
                            tp_preset=tp_preset_model, ep_preset=config.preset_model,
                            zero_offload_optimizer=zero_offload_optimizer, zero_offload_param=zero_offload_param)
