"""``engine.save_checkpoint`` in DeepSpeed 0.19's own layout (``"checkpoint": {"format": "deepspeed"}``).

Owns building the files real DeepSpeed's ``load_checkpoint`` reads at the saving data-parallel
world size and ZeRO stage (names in ``deepspeed_layout``), from the engine's ``parts``:

- ``mp_rank_00_model_states.pt`` (stages 0-2, rank 0) or ``zero_pp_rank_R_mp_rank_00_model_states.pt``
  (stage 3, every rank): the module's state dict (stage 3: empty placeholders for the params the
  optimizer holds), ``buffer_names``, ``param_shapes``, ``frozen_param_*``, ``shared_params``, the
  LR scheduler, counters, ``ds_config``, ``ds_version`` and the client state; stage 0 adds the
  client optimizer's state dict (``optimizer``).
- ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` (ZeRO, every rank R): stages 1/2 each param
  group as one flat vector cut into equal partitions (padded to a multiple of 2 x world size, the
  padding on the last rank, dropped from its saved fp32 partition but kept in its Adam moments, as
  DeepSpeed's rigid ``state_dict``); stage 3 every parameter cut into ``ceil(numel / world)``
  elements per rank, concatenated (``fp32_flat_groups``), in DeepSpeed's sub-groups
  (``zero_optimization.sub_group_size``). Where ``engine.optimizer`` is ``BF16_Optimizer`` (bf16
  ZeRO-1 with fp32 gradient sums, a bf16 pipeline at stage 0) that optimizer's ``state_dict``
  instead (``deepspeed_bf16``), at stage 0 too, rank 0's also in the model states.
- ``latest`` (rank 0, last): the tag's name.

DeepSpeed's classes in these files (its loss scaler, ``fragment_address``) are written by name
(``deepspeed_pickle``); nothing of dslaunch is pickled, so DeepSpeed reads them without dslaunch.

Each rank gathers the whole fp32 state (all-gather of the ZeRO shards) and contributes only its own
files. They are written and published by dslaunch's own save protocol (``writer.write_tag``), so a
DeepSpeed-format tag is as safe as a dslaunch one: written into ``.tmp-<tag>``, renamed into place
with a ``manifest.json`` (sizes and checksums; its ``meta.format`` is ``"deepspeed"``; DeepSpeed
ignores it), ``latest`` replaced last; a save killed or failed at any point leaves the previous tag
and ``latest`` as they were. ``checkpoint.async_save`` (the files are serialized and written on the
writer thread, from a copy in host memory), ``fsync`` and ``keep_last`` (retention among the tags
with a manifest) apply as to dslaunch's format.

An AutoEP run's tag (``deepspeed_autoep``) has DeepSpeed's names for the converted blocks' weights,
a file per global expert (ZeRO 0-2), and ``ds_autoep_layers`` in the model states; at ZeRO-3
DeepSpeed's ``zero3_partitioned`` layout (``deepspeed_autoep_zero3``): the experts only in the
optimizer shards, cut over each expert rank's expert-data group, and ``ds_zero_partition_groups``.

A pipeline's tag (``deepspeed_pipe``) has these files per stage (``mp_rank_SS``, the model states
without ``module``) and a ``layer_XX-model_states.pt`` per layer, from data-parallel rank 0 of each stage.

AutoTP training's tag (``deepspeed_tp_write``) has these files per tensor rank (``mp_rank_TT``),
each of DeepSpeed's slices, re-cut from the whole where dslaunch's planner cut elsewhere.

Limitations: no Megatron mpu's tensor parallelism, AutoTP at ZeRO stages 0-2 only, pipelines at ZeRO stages 0 and 1 only (as
DeepSpeed's) and without MoE, no ``deepspeed.moe`` layers at ZeRO-3 (nor experts marked by
hand, nor MoE layers beside AutoEP blocks), no node-local storage; each rank holds the whole fp32 state once while saving (host memory),
and an async save keeps its copy of the rank's files in host memory between saves. DeepSpeed also
copies its ``zero_to_fp32.py`` into the tag: dslaunch does not ship DeepSpeed's script
(``python -m deepspeed.utils.zero_to_fp32`` reads these files).
"""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from typing import Any

import torch

import dslaunch
from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint import deepspeed_autoep as autoep
from dslaunch.runtime.checkpoint import deepspeed_autoep_zero3 as zero3
from dslaunch.runtime.checkpoint.deepspeed_bf16 import bf16_optimizer_state
from dslaunch.runtime.checkpoint.deepspeed_experts import dense_state, expert_files, moe_layers
from dslaunch.runtime.checkpoint.deepspeed_layout import (
    expert_optim_name,
    model_states_name,
    optim_states_name,
)
from dslaunch.runtime.checkpoint.deepspeed_pickle import fragment_address, loss_scaler, to_bytes
from dslaunch.runtime.checkpoint.deepspeed_pipe import layer_files, stage_states
from dslaunch.runtime.checkpoint.deepspeed_tp_write import autotp_slices
from dslaunch.runtime.checkpoint.experts import ep_rank, expert_names, live_experts
from dslaunch.runtime.checkpoint.format import Encoded
from dslaunch.runtime.checkpoint.model_parallel import describe
from dslaunch.runtime.checkpoint.parts import CheckpointParts
from dslaunch.runtime.checkpoint.reshard import assemble
from dslaunch.runtime.checkpoint.store import CheckpointStore
from dslaunch.runtime.checkpoint.writer import TagWrite
from dslaunch.runtime.moe.autoep_state import local_layout
from dslaunch.runtime.zero.full_state import module_state_dict, shared_params

__all__ = ["DEEPSPEED_VERSION", "deepspeed_job"]

log = logging.getLogger("dslaunch.checkpoint")

DEEPSPEED_VERSION = "0.19.8"
"""The DeepSpeed release whose layout these files follow (its ``ds_version``)."""

# DeepSpeed aligns each flat group to this many elements per rank (4 bytes of 16-bit values)
_ALIGNMENT = 2
# DeepSpeed's default zero_optimization.sub_group_size (elements per rank in one ZeRO-3 sub-group)
_SUB_GROUP_SIZE = 1_000_000_000


def _whole_groups(ck: Any, zero_sd: dict, experts: dict[int, list[str]], part: str) -> list[dict]:
    """Every param group whole ([0, numel)), from all ranks' shards; an expert group from the
    ranks holding the same experts as this one (``experts``: group -> global names), a pipeline
    stage's from the ranks of that ``part``. collective."""
    full = [(0, int(g["numel"])) for g in zero_sd["groups"]]
    if all((int(g["start"]), int(g["end"])) == r for g, r in zip(zero_sd["groups"], full, strict=True)):
        return zero_sd["groups"]
    shards = ck.comm.all_gather_object(({**zero_sd, "groups": [
        {**g, "master": g["master"].detach().cpu(), "optim_state": {k: v.detach().cpu() for k, v in
                                                                    g["optim_state"].items()}}
        for g in zero_sd["groups"]]}, experts, part))
    return [assemble([{**s, "groups": [s["groups"][gi]]} for s, theirs, where in shards
                      if theirs.get(gi) == experts.get(gi) and where == part], [whole])["groups"][0]
            for gi, whole in enumerate(full)]


def _scalars(group: dict) -> dict[str, Any]:
    """The optimizer's per-group scalars as torch's Adam keeps them (``step`` a float tensor)."""
    return {k: (v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v)))
            if k == "step" else v for k, v in group["optim_scalars"].items()}


def _adam_state(group: dict, lo: int, hi: int, size: int) -> dict[str, Any]:
    """Scalars, and each moment's [lo, hi) of the group's flat vector zero-padded to ``size``."""
    out = _scalars(group)
    for k, v in group["optim_state"].items():
        part = v.reshape(-1)[lo:hi].float()
        out[k] = torch.cat([part, part.new_zeros(size - part.numel())])
    return out


def _base_optimizer(groups: list[dict], states: list[dict]) -> dict:
    """A torch optimizer state dict with one flat parameter per group."""
    return {"state": {i: s for i, s in enumerate(states)},
            "param_groups": [{**g["hparams"], "params": [i]} for i, g in enumerate(groups)]}


def _share(numel: int, world: int) -> int:
    """Elements per rank of a flat group of ``numel`` padded to a multiple of 2 x ``world``."""
    return math.ceil(numel / (_ALIGNMENT * world)) * _ALIGNMENT


def _zero12_file(groups: list[dict], splits: list[tuple[int, int]], stage: int, clip: float) -> dict:
    """This rank's ZeRO-1/2 optimizer state, as DeepSpeed's rigid ``state_dict``; ``splits``: per
    group, the ranks it is cut over and this rank's index among them (an expert group: its
    expert-data group)."""
    fp32, states, paddings, mappings = [], [], [], []
    for g, (world, rank) in zip(groups, splits, strict=True):
        numel = int(g["numel"])
        size = _share(numel, world)
        padded = size * world
        lo, hi = min(rank * size, numel), min((rank + 1) * size, numel)
        fp32.append(g["master"].reshape(-1)[lo:hi].float().clone())
        states.append(_adam_state(g, lo, hi, size))
        paddings.append(padded - numel if rank == world - 1 else 0)
        mapping, offset = OrderedDict(), 0
        for name, shape in zip(g["names"], g["shapes"], strict=True):
            n = math.prod(shape)
            a, b = max(offset, lo), min(offset + n, hi)
            if a < b:
                mapping[name] = fragment_address(b - a, a - lo)
            offset += n
        mappings.append(mapping)
    return {"loss_scaler": loss_scaler(), "dynamic_loss_scale": False, "overflow": False, "clip_grad": float(clip),
            "base_optimizer_state": _base_optimizer(groups, states), "single_partition_of_fp32_groups": fp32,
            "zero_stage": stage, "group_paddings": paddings,
            "param_alignment_paddings": [[0] * len(g["names"]) for g in groups],
            "partition_count": [world for world, _ in splits], "ds_version": DEEPSPEED_VERSION,
            "param_slice_mappings": mappings}


def _stage3_slices(flat: torch.Tensor, shapes: list, rank: int, world: int) -> torch.Tensor:
    """This rank's ``ceil(numel / world)`` elements of each parameter in ``flat``, zero-padded."""
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        part = math.ceil(n / world)
        lo, hi = offset + min(rank * part, n), offset + min((rank + 1) * part, n)
        piece = flat[lo:hi].float()
        out.append(torch.cat([piece, piece.new_zeros(part - piece.numel())]))
        offset += n
    return torch.cat(out) if out else torch.empty(0)


def _sub_groups(shapes: list, world: int, sub_group_size: int) -> list[range]:
    """DeepSpeed's ZeRO-3 sub-groups of one param group: parameters in order, a sub-group closed
    once its per-rank elements reach ``sub_group_size`` (all in one when the group is no larger)."""
    parts = [math.ceil(math.prod(s) / world) for s in shapes]
    if sub_group_size >= sum(parts):
        return [range(len(shapes))]
    out, first, size = [], 0, 0
    for i, n in enumerate(parts):
        size += n
        if size >= sub_group_size or i == len(parts) - 1:
            out.append(range(first, i + 1))
            first, size = i + 1, 0
    return out


def _zero3_file(groups: list[dict], parts: list[tuple[int, int, list[int], str | None]], world: int,
                sub_group_size: int) -> dict:
    """This rank's ZeRO-3 optimizer state, as DeepSpeed's ``_rigid_state_dict``: one flat fp32
    partition per sub-group, each a parameter of its param group in the inner optimizer. ``parts``:
    per group, the ranks it is cut over, this rank's index, their global ranks and the expert
    group's name (an AutoEP group: its expert-data group; ``deepspeed_autoep_zero3``)."""
    fp32, states, param_groups, units = [], [], [], []
    for g, (count, rank, ranks, name) in zip(groups, parts, strict=True):
        ids = []
        offsets = [0]
        for shape in g["shapes"]:
            offsets.append(offsets[-1] + math.prod(shape))
        for sub in _sub_groups(g["shapes"], count, sub_group_size):
            lo, hi = offsets[sub.start], offsets[sub.stop]
            shapes = g["shapes"][sub.start:sub.stop]
            fp32.append(_stage3_slices(g["master"].reshape(-1)[lo:hi], shapes, rank, count))
            state = _scalars(g)
            state.update({k: _stage3_slices(v.reshape(-1)[lo:hi], shapes, rank, count)
                          for k, v in g["optim_state"].items()})
            ids.append(len(states))
            states.append(state)
            units.append((count, rank, ranks, name))
        param_groups.append({**g["hparams"], "params": ids})
    out = {"zero_stage": 3, "loss_scaler": loss_scaler(), "dynamic_loss_scale": False, "overflow": False,
           "partition_count": world}
    placement = zero3.partition_groups(units)
    if placement is not None:
        out[zero3.PARTITION_GROUPS_KEY] = placement
    return {**out, "optimizer_state_dict": {"state": dict(enumerate(states)), "param_groups": param_groups},
            "fp32_flat_groups": fp32}


def _stage0_optimizer(groups: list[dict]) -> dict:
    """The client optimizer's state dict (torch's, parameters numbered in group order)."""
    state, param_groups, index = {}, [], 0
    for g in groups:
        ids = []
        offset = 0
        for shape in g["shapes"]:
            n = math.prod(shape)
            entry = _scalars(g)
            entry.update({k: v.reshape(-1)[offset:offset + n].float().view(tuple(shape)).clone()
                          for k, v in g["optim_state"].items()})
            if g["optim_state"]:
                state[index] = entry
            ids.append(index)
            index += 1
            offset += n
        param_groups.append({**g["hparams"], "params": ids})
    return {"state": state, "param_groups": param_groups}


def _buffer_names(module: torch.nn.Module) -> list[str]:
    """Persistent buffers, by their state-dict names (DeepSpeed's ``_get_buffer_names``)."""
    out = []
    for prefix, m in module.named_modules():
        out += [f"{prefix}.{n}" if prefix else n for n, b in m.named_buffers(recurse=False)
                if b is not None and n not in m._non_persistent_buffers_set]
    return out


def _frozen(module: torch.nn.Module, sd: dict, rank: int, world: int, partitioned: bool) -> tuple[dict, dict]:
    """``frozen_param_shapes`` and this rank's ``frozen_param_fragments`` (stage 3: its slice)."""
    shapes, frags = OrderedDict(), OrderedDict()
    for name, p in module.named_parameters():
        if p.requires_grad or name not in sd:
            continue
        whole = sd[name]
        shapes[name] = torch.Size(whole.shape)
        frags[name] = _stage3_slices(whole.reshape(-1), [whole.shape], rank, world).to(whole.dtype) \
            if partitioned else whole
    return shapes, frags


def _model_states(parts: CheckpointParts, groups: list[dict], stage: int, rank: int, world: int,
                  client_state: dict, exclude_frozen: bool, edp: tuple[int, int] = (1, 0)) -> dict:
    module = parts.module
    trained = {n for g in groups for n in g["names"]}  # DeepSpeed's names (an AutoEP block's w1, w2, w3)
    layers = moe_layers(module)
    blocks = autoep.autoep_blocks(module)
    ours = set(autoep.names_from_deepspeed(blocks, sorted(trained))) if blocks else trained
    with local_layout(module):  # AutoEP: this rank's rows (ZeRO 0-2: no collective, one rank writes this file)
        sd = module_state_dict(module, exclude_frozen, skip=frozenset(ours) if stage == 3 else frozenset())
    if layers:  # the experts' weights are in files of their own
        sd = dense_state(sd)
    shapes = {n: s for g in groups for n, s in zip(g["names"], g["shapes"], strict=True)}
    autoep_layers = autoep.metadata(blocks, sd, edp[1], edp[0], shapes=shapes if stage == 3 else None,
                                    partitioned=stage == 3) if blocks else None
    if blocks:  # as DeepSpeed's AutoEP blocks name their weights; the experts in files of their own
        sd = autoep.module_file(blocks, sd)
    if stage == 3:  # DeepSpeed's partitioned params (and a router's alias) are empty in its module state dict
        sd = OrderedDict((k, torch.empty(0, dtype=v.dtype) if k in trained or autoep.is_alias(blocks, k) else v)
                         for k, v in sd.items())
    training = parts.training.state_dict()
    zero = stage > 0
    frozen = _frozen(module, sd, rank, world, stage == 3) if stage >= 2 and not exclude_frozen else (None, None)
    state = {"module": sd, "buffer_names": _buffer_names(module),
             "optimizer": _stage0_optimizer(groups) if not zero and parts.optimizer is not None else None,
             "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in zip(g["names"], g["shapes"], strict=True))
                              for g in groups] if zero and parts.optimizer is not None else None,
             "frozen_param_shapes": frozen[0], "shared_params": shared_params(module) if zero else None,
             "frozen_param_fragments": frozen[1], "lr_scheduler": training.get("lr_scheduler"),
             "data_sampler": _data_sampler(training.get("dataloader")), "random_ltd": training.get("random_ltd"),
             "skipped_steps": int(training["skipped_steps"]),
             "global_steps": int(training["global_steps"]), "global_samples": int(training["global_samples"]),
             "dp_world_size": world, "mp_world_size": 1,
             "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
             "ds_config": dict(parts.ds_config), "ds_version": DEEPSPEED_VERSION}
    if layers or blocks:
        state.update(num_experts=[m.num_experts for _, m in layers] + [b.num_experts for b in blocks],
                     ds_autoep_layers=autoep_layers)
    if blocks:
        state["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.4,
                                              "expert_parameter_patterns": [r".*\.experts\.w[123]$"],
                                              "ds_autoep_layers": autoep_layers}
    state.update(client_state)
    return state


def _deepspeed_names(blocks: list, group: dict) -> dict:
    """A whole param group in the names and order of DeepSpeed's AutoEP blocks
    (``deepspeed_autoep.to_deepspeed``: each block's fused weights split into ``w1``, ``w2``, ``w3``)."""
    def per_param(flat: torch.Tensor) -> dict:
        out, offset = OrderedDict(), 0
        for name, shape in zip(group["names"], group["shapes"], strict=True):
            n = math.prod(shape)
            out[name] = flat.reshape(-1)[offset:offset + n].view(tuple(shape))
            offset += n
        return out

    def flat(named: dict) -> torch.Tensor:
        return torch.cat([v.reshape(-1) for v in named.values()]) if named else torch.empty(0)

    master = autoep.to_deepspeed(blocks, per_param(group["master"]))
    return {**group, "names": list(master), "shapes": [tuple(v.shape) for v in master.values()], "master": flat(master),
            "optim_state": {k: flat(autoep.to_deepspeed(blocks, per_param(v))) for k, v in group["optim_state"].items()}}


def _expert_params(zero_sd: dict) -> list[str]:
    return [n for g in zero_sd["groups"] if "reduce_group" in g for n in g["names"]]


def _refuse(parts: CheckpointParts, zero_sd: dict) -> None:
    place = parts.placement
    experts = [g["reduce_group"] for g in zero_sd["groups"] if "reduce_group" in g]
    if place is not None and experts and (place.layers is not None or place.tensors):  # dslaunch's refuses too
        raise CheckpointError(f"saving expert parameters ({experts[0]}) with a pipeline or AutoTP "
                              f"({describe(place.shape)}) is not supported yet in either checkpoint.format")
    autotp = place is not None and place.layers is None and place.tensors is not None  # deepspeed_tp_write
    what = ("tensor parallelism (an mpu, a pipeline's model axis)" if place is not None and not autotp and (
        place.layers is None or place.shape.get("model", 1) > 1) else
            "a pipeline at ZeRO stage 2 or 3 (DeepSpeed's PipelineEngine runs stages 0 and 1)"
            if place is not None and not autotp and parts.zero.stage > 1 else
            "checkpoint.use_node_local_storage" if parts.config.use_node_local_storage else
            "deepspeed.moe layers beside AutoEP blocks" if moe_layers(parts.module) and autoep.autoep_blocks(parts.module)
            else
            "expert (MoE) parameters at ZeRO stage 3 (DeepSpeed refuses its MoE layer there)"
            if parts.zero.stage == 3 and moe_layers(parts.module) else
            "expert parameters outside an MoE layer's experts (marked by hand: DeepSpeed's files number experts)"
            if not set(_expert_params(zero_sd)) <= set(expert_names(parts.module)) | autoep.expert_weight_names(
                autoep.autoep_blocks(parts.module))
            else None)
    if what:
        raise CheckpointError(f'checkpoint.format "deepspeed" cannot save {what} yet: use format "dslaunch"')


def _data_sampler(position: dict | None) -> dict | None:
    """A curriculum loader's position as DeepSpeed's sampler saves it (numpy's global random state in
    ``np_rng_state``, which its ``load_state_dict`` restores), the sampler's own generator beside it
    (``sampler_rng_state``, which dslaunch restores); None for any other loader."""
    if not isinstance(position, dict) or "curriculum_step" not in position:
        return None
    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    # plain Python values: readable by torch.load(weights_only=True); numpy's set_state takes them
    legacy = (name, keys.tolist(), int(pos), int(has_gauss), float(cached))
    return {**position, "np_rng_state": legacy, "sampler_rng_state": position["np_rng_state"]}


def _zero3_parts(parts: CheckpointParts, splits: list[tuple[int, int]], experts: dict,
                 blocks: list) -> list[tuple[int, int, list[int], str | None]]:
    """Per param group: the ranks its ZeRO-3 state is cut over, this rank's index, their global
    ranks, and (an AutoEP expert group) DeepSpeed's name of its group (``ep_size_<ep>``)."""
    import torch.distributed as dist

    comm = parts.io.comm
    out = []
    for gi, (count, index) in enumerate(splits):
        if gi not in experts:
            out.append((count, index, list(range(comm.world_size)), None))
            continue
        pg = parts.zero.group_comm(gi)[2]
        ranks = [comm.rank] if count == 1 or pg is None else list(dist.get_process_group_ranks(pg))
        out.append((count, index, ranks, f"ep_size_{blocks[0].ep_size}" if blocks else None))
    return out


def deepspeed_job(parts: CheckpointParts, save_dir: str | os.PathLike, tag: str, client_state: dict | None,
                  save_latest: bool, exclude_frozen_parameters: bool) -> TagWrite:
    """What this rank writes into ``save_dir/tag`` in DeepSpeed's layout (the module docstring),
    ``tag`` already agreed by every rank. The save protocol (``writer.write_tag``) writes and
    publishes it as it does a dslaunch tag.

    Raises:
        CheckpointError: a layout DeepSpeed's files cannot express.

    collective: call on all ranks (ZeRO-1/2/3 gather the whole fp32 state).
    """
    ck = parts.io
    rank, world = ck.comm.rank, ck.comm.world_size
    zero_sd = parts.zero.state_dict()
    _refuse(parts, zero_sd)
    stage = int(parts.zero.stage)
    experts = live_experts(parts.module, zero_sd)
    place = parts.placement
    groups = _whole_groups(ck, zero_sd, experts, place.part if place else "")
    blocks = autoep.autoep_blocks(parts.module)
    if blocks:
        groups = [_deepspeed_names(blocks, g) for g in groups]
    splits = [parts.zero.group_comm(gi)[:2] for gi in range(len(groups))]
    edp = next((splits[gi] for gi in experts), (1, 0))
    files: dict[str, Any] = {}
    tp = autotp_slices(parts, groups, parts.module.state_dict) \
        if place is not None and place.layers is None and place.tensors is not None else None
    if tp is not None:  # AutoTP: DeepSpeed's slices; data-parallel rank 0 of each tensor rank writes its states
        groups = tp.groups
        if place.data == 0:
            files[model_states_name(None, tp.rank)] = tp.model_states(_model_states(
                parts, groups, stage, 0, place.shape.get("data", 1), client_state or {}, exclude_frozen_parameters))
    elif place is not None:  # a pipeline: data-parallel rank 0 of each stage writes the stage's states
        if place.data == 0:
            files[model_states_name(None, place.coord.get("pipe", 0))] = stage_states(_model_states(
                parts, groups, stage, 0, place.shape.get("data", 1), client_state or {}, exclude_frozen_parameters),
                place)
            files.update(layer_files(parts.module.state_dict(), place))
    elif stage == 3 or rank == 0:
        files[model_states_name(rank if stage == 3 else None)] = _model_states(
            parts, groups, stage, rank, world, client_state or {}, exclude_frozen_parameters, edp)
    if experts and stage < 3:  # expert-data rank 0 writes its experts (and, without ZeRO, their optimizer state)
        writer = all(splits[gi][1] == 0 for gi in experts)
        with local_layout(parts.module):
            local = parts.module.state_dict()
        files.update(expert_files(parts.module, local, writer))
        files.update(autoep.expert_files(blocks, local) if writer else {})
        if writer and stage == 0 and parts.optimizer is not None:
            files[expert_optim_name(blocks[0].ep_rank if blocks else ep_rank(moe_layers(parts.module)[0][1].deepspeed_moe))] = \
                {"optimizer": _stage0_optimizer(groups)}
    if (stage > 0 or parts.bf16_optimizer) and parts.optimizer is not None:
        sub_group_size = int((parts.ds_config.get("zero_optimization") or {}).get("sub_group_size", _SUB_GROUP_SIZE))
        if stage == 0:  # BF16_Optimizer cuts each group over the data-parallel ranks (of the stage) as ZeRO-1 does
            splits = [(place.shape.get("data", 1), place.data) if place else (world, rank)] * len(groups)
        osd = _zero3_file(groups, _zero3_parts(parts, splits, experts, blocks), world, sub_group_size) \
            if stage == 3 else \
            _zero12_file(groups, splits, stage, parts.gradient_clipping)
        if parts.bf16_optimizer:
            osd = bf16_optimizer_state(osd, [_share(int(g["numel"]), n) for g, (n, _) in zip(groups, splits, strict=True)])
            for name in [n for n in files if n.startswith("mp_rank_")] if stage == 0 else []:
                files[name] = {**files[name], "optimizer": osd}  # DeepSpeed's stage 0 saves rank 0's here too
        name = optim_states_name(place.data, parts.bf16, tp.rank if tp else place.coord.get("pipe", 0)) if place else \
            optim_states_name(rank, parts.bf16)
        files[name] = {"optimizer_state_dict": osd, "ds_config": dict(parts.ds_config), "ds_version": DEEPSPEED_VERSION}
    cfg = parts.config
    meta = {"format": "deepspeed", "ds_version": DEEPSPEED_VERSION, "world_size": world, "zero_stage": stage,
            "global_steps": parts.global_steps}
    return TagWrite(CheckpointStore(save_dir, durable=cfg.fsync), tag,
                    {name: Encoded(obj, to_bytes) for name, obj in files.items()}, meta, leader=rank == 0,
                    save_latest=save_latest, keep_last=cfg.keep_last or 0, library_version=dslaunch.__version__)
