"""Reading a checkpoint real DeepSpeed wrote into whole per-parameter state.

Owns the meaning of DeepSpeed 0.19's files (names in ``deepspeed_layout``): which fp32 elements of
which data-parallel rank belong to which parameter, at ZeRO stages 1/2 (each param group one flat
vector cut into equal partitions, the last one padded; DeepSpeed saves each rank's partition
without that padding, and may pad between parameters: ``param_alignment_paddings``) and stage 3
(every parameter cut into ``ceil(numel / world)`` elements per rank, the last rank's padded),
and at stage 0 (the client optimizer's own state dict, per parameter). The result,
``DeepSpeedState``, holds each trained parameter's whole fp32 master and optimizer state
(``exp_avg``, ``exp_avg_sq``, ...), each param group's scalars (``step``) and hyperparameters, the
module's other weights and buffers, and the model-states file (counters, scheduler, client
state); ``deepspeed_load`` places it at the engine's world size and stage.

Files are read with ``torch.load(weights_only=True)``: DeepSpeed's own pickled classes (its loss
scaler, its ZeRO stage enum) are read as plain stand-ins that keep their attributes. Nothing is
written.

MoE checkpoints (``deepspeed_experts``): the experts' files add their weights under global expert
numbers, and an expert param group's partitions are joined per expert rank and named globally.

Pipelines (``deepspeed_pipe``) and AutoTP (``deepspeed_tp``): each stage's or tensor-parallel
rank's files read as one such checkpoint, then joined.

Limitations: MoE optimizer
state without ZeRO (``expp_rank_*`` files) only at the saving expert-parallel size, no NVMe-offloaded
optimizer state (``offloaded_tensors/``); each rank reads every
optimizer file (host memory: the whole fp32 state once per rank).
"""

from __future__ import annotations

import math
import pickle
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.deepspeed_autoep_zero3 import PARTITION_GROUPS_KEY, expert_units
from dslaunch.runtime.checkpoint.deepspeed_bf16 import is_bf16_optimizer_state, slice_shapes
from dslaunch.runtime.checkpoint.deepspeed_experts import expert_sets, renumber
from dslaunch.runtime.checkpoint.deepspeed_layout import (
    expert_optim_name,
    is_pipeline,
    model_states_name,
    optim_states_name,
)
from dslaunch.runtime.checkpoint.experts import EXPERT_PREFIX

__all__ = ["DeepSpeedGroup", "DeepSpeedState", "read_deepspeed", "read_part", "read_file", "read_checkpoint_file"]


class _StandIn:
    """A DeepSpeed object in a checkpoint (``LossScaler``, ``ZeroStageEnum``, ...), read without
    DeepSpeed: its constructor arguments in ``args``, its attributes as they were."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


def _stand_in(qualified: str) -> type:
    module, _, name = qualified.rpartition(".")
    return type(name, (_StandIn,), {"__module__": module, "__qualname__": name})


def _scaler_state(scaler: Any) -> dict[str, Any]:
    """A DeepSpeed loss scaler's attributes (``cur_scale``, ...): from a stand-in, or from
    dslaunch's DeepSpeed-named class where the caller allowed it (``add_safe_globals``)."""
    from dslaunch.runtime.fp16.loss_scaler import LossScalerBase

    if isinstance(scaler, _StandIn):
        return {k: v for k, v in vars(scaler).items() if k != "args"}
    return scaler.__getstate__() if isinstance(scaler, LossScalerBase) else {}


def read_file(path: Path, stand_in_modules: tuple[str, ...] = ("deepspeed.",)) -> dict:
    """One DeepSpeed ``.pt`` file, on the CPU, with ``weights_only=True``; the classes of the
    packages ``stand_in_modules`` name are read as stand-ins (``_StandIn``).

    Raises:
        CheckpointError: missing, unreadable or truncated, or it needs a class that is neither
            DeepSpeed's nor allowed by ``torch.serialization.add_safe_globals``.
    """
    if not path.is_file():
        raise CheckpointError("missing: the DeepSpeed checkpoint has no such file", str(path))
    unsafe: list[str] = []
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        stand_ins = [_stand_in(g) for g in unsafe if g.startswith(stand_in_modules)]
        with torch.serialization.safe_globals(stand_ins):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        others = [g for g in unsafe if not g.startswith(stand_in_modules)]
        raise CheckpointError(f"needs classes {others[:5]} that torch.load(weights_only=True) does not "
                              "load: if you trust the file, allow them with "
                              f"torch.serialization.add_safe_globals before load_checkpoint ({exc})"[:600],
                              str(path)) from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"unreadable or truncated ({type(exc).__name__}: {str(exc)[:200]})", str(path)) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"holds a {type(obj).__name__}, not a DeepSpeed state dict", str(path))
    return obj


def read_checkpoint_file(path: Path) -> dict:
    """``read_file`` for the files Megatron-DeepSpeed writes too (``deepspeed.checkpoint``'s
    readers): its ``args`` (an ``argparse.Namespace``, allowed as it is) and its enums (read as
    stand-ins) load with ``weights_only=True``."""
    import argparse

    with torch.serialization.safe_globals([argparse.Namespace]):
        return read_file(path, stand_in_modules=("deepspeed.", "megatron."))


def _need(sd: dict, key: str, path: Path, kind: type | tuple[type, ...]) -> Any:
    if key not in sd:
        raise CheckpointError(f"key {key!r} is missing: not a DeepSpeed 0.19 checkpoint file", str(path))
    if not isinstance(sd[key], kind):
        raise CheckpointError(f"key {key!r} is a {type(sd[key]).__name__}, expected {kind}", str(path))
    return sd[key]


@dataclass(frozen=True)
class DeepSpeedGroup:
    """One optimizer param group: its trained parameters (in DeepSpeed's order), the optimizer's
    scalars for it (``step``) and its hyperparameters (``lr``, ``betas``, ...)."""

    names: list[str]
    scalars: dict[str, Any]
    hparams: dict[str, Any]


@dataclass(frozen=True)
class DeepSpeedState:
    """A DeepSpeed checkpoint tag as whole per-parameter state (see the module docstring)."""

    folder: Path
    model_file: Path
    stage: int
    world_size: int
    states: dict[str, Any]
    """The (rank 0) model-states file: ``module``, counters, ``lr_scheduler``, client keys."""
    module: dict[str, torch.Tensor]
    """Every weight and buffer the module needs (stage 3: whole, frozen params assembled)."""
    fp32: dict[str, torch.Tensor] = field(default_factory=dict)
    """Whole fp32 master per trained parameter (empty when the optimizer state was not read)."""
    optim: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Whole per-element optimizer state per trained parameter: name -> {"exp_avg": ...}."""
    groups: list[DeepSpeedGroup] = field(default_factory=list)
    loss_scaler: dict[str, Any] = field(default_factory=dict)


def read_deepspeed(folder: Path, optimizer: bool = True, trained: list[str] | None = None) -> DeepSpeedState:
    """Read the DeepSpeed tag ``folder``; a pipeline's (``layer_XX-model_states.pt``): every stage's
    files, by ``deepspeed_pipe.read_pipeline``; AutoTP's (``mp_rank_01`` without layer files):
    every tensor-parallel rank's, by ``deepspeed_tp.read_tensor_parallel``.

    Args:
        optimizer: read the fp32 masters and optimizer state (stage 3 reads its weights there
            anyway). False: weights come from the module (DeepSpeed's ``load_module_only``).
        trained: the live engine's trained parameter names in its optimizer's order; stage 0's
            optimizer state has no names, only that order. None (no engine: an export): stage 0
            gives the module's weights only.
    Raises:
        CheckpointError: a file is missing, truncated or not what DeepSpeed writes (names it).
    """
    if is_pipeline(folder):
        from dslaunch.runtime.checkpoint.deepspeed_pipe import read_pipeline  # it reads each stage here

        return read_pipeline(folder, optimizer, trained)
    from dslaunch.runtime.checkpoint.deepspeed_tp import is_tensor_parallel, read_tensor_parallel

    if is_tensor_parallel(folder):
        return read_tensor_parallel(folder, optimizer, trained)
    return read_part(folder, optimizer, trained)


def read_part(folder: Path, optimizer: bool = True, trained: list[str] | None = None, mp_rank: int = 0
              ) -> DeepSpeedState:
    """``read_deepspeed`` of the files of model-parallel rank ``mp_rank`` alone (a pipeline
    stage's: its parameters, its optimizer files)."""
    partitioned = (folder / model_states_name(0, mp_rank)).exists()
    model_file = folder / model_states_name(0 if partitioned else None, mp_rank)
    states = read_file(model_file)
    _need(states, "module", model_file, (dict, type(None)))
    world = _need(states, "dp_world_size", model_file, int)
    shapes = states.get("param_shapes")
    zero = shapes is not None
    if zero and not (isinstance(shapes, list) and all(isinstance(s, dict) for s in shapes)):
        raise CheckpointError("key 'param_shapes' is not a list of {name: shape}", str(model_file))
    module = dict(states["module"] or {})  # a pipeline stage's is None: its layers have files
    if isinstance(states.get("num_experts"), list):  # MoE: each global expert's weights in a file
        for f in sorted(folder.glob("layer_*_expert_*_mp_rank_00_model_states.pt")):
            module.update(read_file(f))
    if partitioned:
        frozen = _frozen_stage3(folder, world, states)
        module.update(frozen)
    base = DeepSpeedState(folder, model_file, 3 if partitioned else (1 if zero else 0), world, states, module)
    if not zero and is_bf16_optimizer_state(states.get("optimizer")):  # BF16_Optimizer: files name params
        if not optimizer:
            return base
        files = _optim_files(folder, world, mp_rank)
        osds = [_bf16_state(read_file(f), f) for f in files]
        return _zero(base, slice_shapes(osds, files, module), osds, files, False)
    if not zero and trained is None:
        return base  # the optimizer state names no parameter: only an engine's order could place it
    if not zero and isinstance(states.get("num_experts"), list) and optimizer:
        return _stage0_experts(base, trained)
    if not zero:
        return _stage0(base, optimizer, trained)
    if not optimizer and not partitioned:
        return base
    files = _optim_files(folder, world, mp_rank)
    shards = [read_file(f) for f in files]
    osds = [_need(sd, "optimizer_state_dict", f, dict) for sd, f in zip(shards, files, strict=True)]
    return _zero(base, shapes, osds, files, partitioned)


def _optim_files(folder: Path, world: int, mp_rank: int) -> list[Path]:
    """Every rank's optimizer file: ``zero_pp_rank_R_...`` or ``bf16_zero_pp_rank_R_...``."""
    for bf16 in (False, True):
        files = [folder / optim_states_name(r, bf16, mp_rank) for r in range(world)]
        if files[0].exists():
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise CheckpointError(f"the checkpoint was saved by {world} data-parallel ranks "
                                      f"(dp_world_size) but {missing[:3]} are missing", str(folder))
            return files
    raise CheckpointError(f"no ZeRO optimizer files ({optim_states_name(0, False, mp_rank)} or "
                          f"{optim_states_name(0, True, mp_rank)}) "
                          f"for the {world} data-parallel ranks the model states name", str(folder))


def _bf16_state(sd: dict, path: Path) -> dict:
    osd = _need(sd, "optimizer_state_dict", path, dict)
    if not is_bf16_optimizer_state(osd):
        raise CheckpointError("holds no BF16_Optimizer state (param_slice_mappings, "
                              "single_partition_of_fp32_groups), as its model states' optimizer does", str(path))
    return osd


def _frozen_stage3(folder: Path, world: int, states: dict) -> dict[str, torch.Tensor]:
    """Stage 3's frozen parameters, whole: each rank saved its partition of each."""
    shapes = states.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    frags = [read_file(folder / model_states_name(r)).get("frozen_param_fragments") or {} for r in range(world)]
    out = {}
    for name, shape in shapes.items():
        parts = [f[name].reshape(-1) for f in frags if name in f]
        if len(parts) != world:
            raise CheckpointError(f"frozen parameter {name!r} has {len(parts)} of {world} partitions", str(folder))
        out[name] = torch.cat(parts)[:math.prod(shape)].view(tuple(shape)).clone()
    return out


def _stage(osd: dict) -> int:
    """ZeRO stage of an optimizer file (DeepSpeed's bf16 optimizer, which has none: 1)."""
    stage = osd.get("zero_stage", 1)
    stage = stage.args[0] if isinstance(stage, _StandIn) and stage.args else getattr(stage, "_value_", stage)
    return int(stage)


def _split_state(state: dict[str, Any], numel: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Per-element tensors (one value per element of the partition, cut to ``numel``: DeepSpeed's
    moments keep the padding its saved fp32 partition drops) apart from scalars (``step``)."""
    tensors = {k: v.reshape(-1)[:numel] for k, v in state.items()
               if torch.is_tensor(v) and v.dim() == 1 and v.numel() >= numel}
    return tensors, {k: v for k, v in state.items() if k not in tensors}


def _hparams(group: dict) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _zero(base: DeepSpeedState, shapes: list[dict], osds: list[dict], files: list[Path],
          partitioned: bool) -> DeepSpeedState:
    stages = {_stage(o) for o in osds}
    want = {3} if partitioned else {0, 1, 2}  # 0: the bf16 optimizer without ZeRO
    if not stages <= want:
        raise CheckpointError(f"the optimizer files are of ZeRO stage {sorted(stages)}, the model states "
                              f"of stage {'3' if partitioned else '1 or 2'}", str(base.folder))
    key = "fp32_flat_groups" if partitioned else "single_partition_of_fp32_groups"
    bos = "optimizer_state_dict" if partitioned else "base_optimizer_state"
    flats, base_sds = [], []
    for o, f in zip(osds, files, strict=True):
        flats.append(_need(o, key, f, list))
        base_sds.append(_need(o, bos, f, dict))
    param_groups = _need(base_sds[0], "param_groups", files[0], list)
    fp32: dict[str, torch.Tensor] = OrderedDict()
    optim: dict[str, dict[str, torch.Tensor]] = {}
    owner: dict[int, int] = {i: g for g, pg in enumerate(param_groups) for i in pg["params"]}
    scalars: dict[int, dict] = {}
    if partitioned:
        units = expert_units([o.get(PARTITION_GROUPS_KEY) for o in osds], base.world_size, str(files[0]))
        names = _unpack_stage3(shapes, flats, base_sds, base.world_size, fp32, optim, scalars, str(base.folder),
                               units)
        group_of_unit = [owner.get(i, 0) for i in range(len(flats[0]))] if len(shapes) == len(flats[0]) \
            else list(range(len(shapes)))
        by_group: dict[int, list[str]] = {}
        for unit, unit_names in enumerate(names):
            by_group.setdefault(group_of_unit[unit], []).extend(unit_names)
        first_unit = {g: min((i for i, o in owner.items() if o == g), default=-1) for g in range(len(param_groups))}
        groups = [DeepSpeedGroup(by_group.get(g, []), scalars.get(first_unit[g], {}), _hparams(pg))
                  for g, pg in enumerate(param_groups)]
    else:
        paddings = osds[0].get("param_alignment_paddings")
        counts = osds[0].get("partition_count")
        names: dict[int, list[str]] = {}
        for g, group_shapes in enumerate(shapes):
            state_key = param_groups[g]["params"][0] if g < len(param_groups) else g
            count = counts[g] if isinstance(counts, list) and g < len(counts) else base.world_size
            # an MoE group is cut over its expert-data peers only, each expert rank's experts apart
            for e, ranks in enumerate(expert_sets(base.world_size, count)):
                flat = torch.cat([flats[r][g].reshape(-1).float() for r in ranks])
                states = [base_sds[r].get("state", {}).get(state_key, {}) for r in ranks]
                per_rank = [_split_state(st, flats[r][g].numel()) for st, r in zip(states, ranks, strict=True)]
                moments = {k: torch.cat([t[k].reshape(-1) for t, _ in per_rank]) for k in per_rank[0][0]}
                scalars[g] = per_rank[0][1]
                renamed = OrderedDict(zip(renumber(list(group_shapes), e), group_shapes.values(), strict=True))
                names.setdefault(g, []).extend(renamed)
                _unpack_flat(renamed, flat, moments, paddings[g] if paddings else None, fp32, optim,
                             f"{base.folder} param group {g}")
        groups = [DeepSpeedGroup(names[g], scalars[g], _hparams(param_groups[g]) if g < len(param_groups) else {})
                  for g in range(len(shapes))]
    module = {**base.module, **fp32}
    scaler = osds[0].get("loss_scaler")
    scaler_sd = _scaler_state(scaler)
    return DeepSpeedState(base.folder, base.model_file, _stage(osds[0]) if not partitioned else 3, base.world_size,
                          base.states, module, fp32, optim, groups, scaler_sd)


def _unpack_flat(shapes: dict, flat: torch.Tensor, moments: dict[str, torch.Tensor], paddings: list | None,
                 fp32: dict, optim: dict, what: str) -> None:
    """Stages 1/2: the group's params lie one after another in ``flat`` (``paddings``: after each)."""
    offset = 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = math.prod(shape)
        if offset + n > flat.numel():
            raise CheckpointError(f"{what}: the fp32 partitions hold {flat.numel()} elements, too few for "
                                  f"{name!r} at {offset} (+{n})")
        fp32[name] = flat[offset:offset + n].view(tuple(shape)).clone()
        optim[name] = {k: m[offset:offset + n].view(tuple(shape)).clone() for k, m in moments.items()}
        offset += n + (int(paddings[i]) if paddings else 0)


def _unpack_stage3(shapes: list[dict], flats: list[list[torch.Tensor]], base_sds: list[dict], world: int,
                   fp32: dict, optim: dict, scalars: dict, what: str,
                   units: list[list[list[int]] | None]) -> list[list[str]]:
    """Stage 3: each rank's sub-groups, concatenated, hold ``ceil(numel / world)`` of each param in
    turn; an AutoEP expert sub-group (``units``, ``deepspeed_autoep_zero3.expert_units``) ``ceil(numel
    / expert-data size)``, each expert rank's param named ``<name>#ep<r>``. Returns the names of each
    unit of ``shapes``."""
    vectors, moments = [], []
    for r in range(world):
        vectors.append(torch.cat([t.reshape(-1).float() for t in flats[r]]))
        per_unit = [_split_state(base_sds[r].get("state", {}).get(i, {}), t.numel()) for i, t in enumerate(flats[r])]
        keys = set(per_unit[0][0]) if per_unit else set()
        moments.append({k: torch.cat([t[k].reshape(-1) for t, _ in per_unit]) for k in keys})
        if r == 0:
            scalars.update({i: s for i, (_, s) in enumerate(per_unit)})
    offset, names = 0, []
    for u, unit in enumerate(shapes):
        # an AutoEP unit is cut over each expert rank's expert-data peers, its name per expert rank
        sets = units[u] if u < len(units) and units[u] is not None else [list(range(world))]
        names.append([])
        for name, shape in unit.items():
            n = math.prod(shape)
            part = math.ceil(n / len(sets[0]))
            if offset + part > vectors[0].numel():
                raise CheckpointError(f"{what}: the fp32 partitions hold {vectors[0].numel()} elements per rank, "
                                      f"too few for {name!r}")
            for e, ranks in enumerate(sets):
                key = renumber([name], e)[0] if len(sets) > 1 else name
                names[-1].append(key)
                fp32[key] = torch.cat([vectors[r][offset:offset + part] for r in ranks])[:n].view(tuple(shape)).clone()
                optim[key] = {k: torch.cat([moments[r][k][offset:offset + part] for r in ranks])[:n]
                              .view(tuple(shape)).clone() for k in moments[0]}
            offset += part
    return names


def _per_element_keys(states: list[dict[str, Any]], params: list[torch.Tensor | None]) -> set[str]:
    """The state keys that hold one value per parameter element (Adam's moments), told from
    scalars (its ``step``, a 0-dim tensor) by shape: a parameter of one element (a bias of size 1)
    has moments of its shape and a 0-dim step, so numel alone cannot tell them apart. Decided for
    the whole group, so a 0-dim parameter follows the others."""
    return {k for state, p in zip(states, params, strict=True) if p is not None and (p.dim() > 0 or p.numel() > 1)
            for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape}


def _stage0(base: DeepSpeedState, optimizer: bool, trained: list[str]) -> DeepSpeedState:
    """No ZeRO: the client optimizer's state dict, per parameter in the optimizer's order."""
    osd = base.states.get("optimizer")
    if not optimizer or osd is None:
        return base
    if not (isinstance(osd, dict) and isinstance(osd.get("param_groups"), list)):
        raise CheckpointError("key 'optimizer' is not an optimizer state dict", str(base.model_file))
    order = [i for g in osd["param_groups"] for i in g["params"]]
    if len(order) != len(trained):
        raise CheckpointError(f"the saved optimizer holds {len(order)} parameters, this engine trains "
                              f"{len(trained)}", str(base.model_file))
    name_of = dict(zip(order, trained, strict=True))
    optim, groups, module = {}, [], base.module
    for g in osd["param_groups"]:
        names = [name_of[i] for i in g["params"]]
        states = [osd.get("state", {}).get(i, {}) for i in g["params"]]
        per_element = _per_element_keys(states, [module.get(n) for n in names])
        scalars: dict[str, Any] = {}
        for name, state in zip(names, states, strict=True):
            optim[name] = {k: v.view(module[name].shape) for k, v in state.items() if k in per_element}
            scalars = {k: v for k, v in state.items() if k not in per_element}
        groups.append(DeepSpeedGroup(names, scalars, _hparams(g)))
    fp32 = {n: module[n].float() for n in trained if n in module}
    return DeepSpeedState(base.folder, base.model_file, 0, base.world_size, base.states, module, fp32, optim, groups)


def _stage0_experts(base: DeepSpeedState, trained: list[str]) -> DeepSpeedState:
    """No ZeRO, MoE: expert rank R's optimizer state dict (``expp_rank_R_...``) numbers the dense
    parameters and R's experts in the optimizer's order; ``trained`` (this engine's, experts
    numbered globally) gives that order at the same expert-parallel size.

    Raises:
        CheckpointError: the checkpoint has another number of expert ranks than this engine.
    """
    files = sorted(base.folder.glob("expp_rank_*_mp_rank_00_optim_states.pt"),
                   key=lambda f: int(f.name.split("_")[2]))
    local = _rank0_numbers(trained)
    merged: DeepSpeedState | None = None
    for r, f in enumerate(files):
        if f.name != expert_optim_name(r):
            raise CheckpointError(f"expected {expert_optim_name(r)} among the expert ranks' optimizer files",
                                  str(base.folder))
        osd = _need(read_file(f), "optimizer", f, dict)
        got = _stage0(replace(base, states={**base.states, "optimizer": osd}), True, renumber(local, r))
        if merged is None:
            merged = got
            continue
        groups = [replace(a, names=a.names + [n for n in b.names if n not in a.names])
                  for a, b in zip(merged.groups, got.groups, strict=True)]
        merged = replace(merged, fp32={**merged.fp32, **got.fp32}, optim={**merged.optim, **got.optim}, groups=groups)
    if merged is None:
        raise CheckpointError("a DeepSpeed MoE checkpoint without ZeRO has no expp_rank_*_optim_states.pt files",
                              str(base.folder))
    missing = [n for n in trained if n not in merged.optim]
    if missing:
        raise CheckpointError(f"the checkpoint has {len(files)} expert ranks' optimizer files, which do not hold "
                              f"{missing[:2]}: load at the expert-parallel size it was saved at, or save at ZeRO "
                              "stage 1 or 2 (loads at any)", str(base.folder))
    return replace(merged, states=base.states)


def _rank0_numbers(names: list[str]) -> list[str]:
    """Expert names renumbered from 0 in each layer (as expert rank 0 numbers its experts)."""
    low: dict[str, int] = {}
    for n in names:
        head, sep, tail = n.partition(EXPERT_PREFIX)
        if sep:
            low[head] = min(low.get(head, 1 << 30), int(tail.split(".", 1)[0]))
    out = []
    for n in names:
        head, sep, tail = n.partition(EXPERT_PREFIX)
        index, _, rest = tail.partition(".")
        out.append(f"{head}{sep}{int(index) - low[head]}.{rest}" if sep else n)
    return out
