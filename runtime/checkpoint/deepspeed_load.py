"""``engine.load_checkpoint`` of a checkpoint real DeepSpeed wrote, at any world size and stage.

Owns placing a ``deepspeed_read.DeepSpeedState`` (whole per-parameter fp32 masters and optimizer
state) into an engine's ``parts``: the module's other weights and buffers through the same path as
dslaunch's own checkpoints (``save_load.load_module_weights``), the masters and moments as one
consolidated strategy state that ``strategy.load_state_dict`` cuts to this rank's range (so the
saving world size and ZeRO stage do not matter), and the counters, LR scheduler and loss scale
into the training part. The flags mean what DeepSpeed's mean: ``load_optimizer_states=False``
keeps the fresh optimizer state (masters from the checkpoint's fp32 weights), and
``load_module_only=True`` takes only the module's weights (masters: those weights, as DeepSpeed's
``refresh_fp32_params``), no counters or scheduler. The client state is what DeepSpeed returns:
the model-states file's keys less those it consumed.

DeepSpeed saves no RNG state and no data position: those stay as they are (as in DeepSpeed).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dslaunch.errors import CheckpointError, CheckpointLayoutError
from dslaunch.runtime.checkpoint.checkpointer import Checkpointer
from dslaunch.runtime.checkpoint.deepspeed_autoep import (
    AutoEPBlock,
    autoep_blocks,
    check_metadata,
    from_deepspeed,
    names_from_deepspeed,
)
from dslaunch.runtime.checkpoint.deepspeed_experts import global_names, localize
from dslaunch.runtime.checkpoint.deepspeed_layout import deepspeed_tag, model_states_name
from dslaunch.runtime.checkpoint.deepspeed_read import DeepSpeedState, read_deepspeed
from dslaunch.runtime.checkpoint.parts import CheckpointParts
from dslaunch.runtime.checkpoint.reshard import cut_slice
from dslaunch.runtime.checkpoint.save_load import load_module_weights, with_masters

__all__ = ["find_deepspeed_tag", "load_deepspeed"]

log = logging.getLogger("dslaunch.checkpoint")

Reader = Callable[[Path, bool, list[str]], DeepSpeedState]
"""(tag folder, read the optimizer state, trained names in the optimizer's order) -> the state."""

# The keys DeepSpeed's load consumes; the rest of the model-states file is the client state.
_ALWAYS = ("module",)
_TRAINING = ("skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler", "random_ltd")
_LOSS_SCALER_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def find_deepspeed_tag(ck: Checkpointer, load_dir: str | os.PathLike, tag: Any) -> Path | None:
    """The DeepSpeed tag folder to load, or None (a dslaunch checkpoint, or none at all).

    Rank 0 decides, so every rank takes the same path. collective: call on all ranks.
    """
    found = deepspeed_tag(load_dir, tag) if ck.comm.rank == 0 else None
    found = ck.comm.all_gather_object(str(found) if found is not None else None)[0]
    return Path(found) if found is not None else None


def _read(ck: Checkpointer, folder: Path, optimizer: bool, trained: list[str], reader: Reader) -> DeepSpeedState:
    """Every rank reads the tag; if any rank fails, all raise the same error."""
    got, err = None, None
    try:
        got = reader(folder, optimizer, trained)
    except CheckpointError as exc:
        err = str(exc)
    errors = [e for e in ck.comm.all_gather_object(err) if e]
    if errors:
        raise CheckpointError(errors[0])
    assert got is not None
    return got


def _consolidated(state: DeepSpeedState, current: dict, strict: bool) -> dict:
    """The live strategy's groups, whole ([0, numel)), from the checkpoint's per-parameter state."""
    group_of = {n: g for g in state.groups for n in g.names}
    groups = []
    for gi, live in enumerate(current["groups"]):
        missing = [n for n in live["names"] if n not in state.fp32]
        if missing:
            raise CheckpointError(f"param group {gi}: parameters {missing[:3]} are not in the DeepSpeed "
                                  "checkpoint", str(state.folder))
        for n, shape in zip(live["names"], live["shapes"], strict=True):
            if tuple(state.fp32[n].shape) != tuple(shape):
                raise CheckpointError(f"{n!r} has shape {tuple(state.fp32[n].shape)} in the checkpoint, "
                                      f"{tuple(shape)} in the model", str(state.folder))
        saved = group_of.get(live["names"][0]) if live["names"] else None
        keys = sorted({k for n in live["names"] for k in state.optim.get(n, {})})
        lacking = [n for n in live["names"] if sorted(state.optim.get(n, {})) != keys]
        if lacking and strict:
            raise CheckpointError(f"param group {gi}: {lacking[:3]} have no optimizer state {keys}",
                                  str(state.folder))
        hparams = dict(live["hparams"])
        hparams.update({k: v for k, v in (saved.hparams if saved else {}).items() if k in hparams})
        groups.append({"names": list(live["names"]), "shapes": [tuple(s) for s in live["shapes"]],
                       "numel": int(live["numel"]), "start": 0, "end": int(live["numel"]),
                       "master": _flat([state.fp32[n] for n in live["names"]]),
                       "optim_state": {} if lacking else {k: _flat([state.optim[n][k] for n in live["names"]])
                                                          for k in keys},
                       "optim_scalars": dict(saved.scalars) if saved and not lacking else {},
                       "hparams": hparams})
    return {**current, "groups": groups}


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in tensors]) if tensors else torch.empty(0)


def _masters_from(weights: dict[str, torch.Tensor], current: dict, folder: Path) -> list[torch.Tensor]:
    """This rank's range of each group's masters, from whole weights (``load_module_only``)."""
    out = []
    for g in current["groups"]:
        missing = [n for n in g["names"] if n not in weights]
        if missing:
            raise CheckpointError(f"parameters {missing[:3]} are not in the DeepSpeed checkpoint's module",
                                  str(folder))
        out.append(_flat([weights[n] for n in g["names"]])[g["start"]:g["end"]])
    return out


def _training(parts: CheckpointParts, state: DeepSpeedState, lr_scheduler: bool, optimizer: bool) -> dict:
    sd = state.states
    training = dict(parts.training.state_dict())
    steps = int(sd.get("global_steps", 0))
    training.update(global_steps=steps, global_samples=int(sd.get("global_samples", training["global_samples"])),
                    skipped_steps=int(sd.get("skipped_steps", 0)), grad_exchange=None, random_ltd=sd.get("random_ltd"),
                    lr_scheduler=sd.get("lr_scheduler") if lr_scheduler else None,
                    # DeepSpeed's curriculum sampler state is the curriculum loader's position; any other is not ours
                    dataloader=sd.get("data_sampler") if "curriculum_step" in (training.get("dataloader") or {}) else None)
    if optimizer and "cur_scale" in state.loss_scaler and isinstance(training.get("loss_scaler"), dict):
        training["loss_scaler"] = {**training["loss_scaler"],
                                   **{k: state.loss_scaler[k] for k in _LOSS_SCALER_KEYS if k in state.loss_scaler}}
    return training


def _client_state(sd: dict, module_only: bool, lr_scheduler: bool, optimizer: bool) -> dict:
    used = set(_ALWAYS) | (set() if module_only else set(_TRAINING))
    used |= {"lr_scheduler"} if lr_scheduler else set()
    used |= {"optimizer"} if optimizer else set()
    return {k: v for k, v in sd.items() if k not in used}


def _sliced(state: DeepSpeedState, layout: dict[str, list]) -> DeepSpeedState:
    """``state`` with each parameter AutoTP cuts (``layout``: name -> [dim, segments, whole,
    transposed]) cut to this rank's slice; a weight the model stores ``[in, out]`` (GPT-2's
    ``Conv1D``, whole in that layout here) is turned to the sharded layers' ``[out, in]`` first."""
    def cut(name: str, t: torch.Tensor) -> torch.Tensor:
        if name not in layout or not torch.is_tensor(t):
            return t
        entry = layout[name]
        return cut_slice(t.t() if len(entry) > 3 and entry[3] and t.dim() == 2 else t, entry).contiguous()

    return replace(state, module={k: cut(k, v) for k, v in state.module.items()},
                   fp32={k: cut(k, v) for k, v in state.fp32.items()},
                   optim={k: {s: cut(k, v) for s, v in st.items()} for k, st in state.optim.items()})


def _autoep(state: DeepSpeedState, blocks: list[AutoEPBlock]) -> DeepSpeedState:
    """``state`` in the names of the model's AutoEP blocks (``deepspeed_autoep``), each expert
    weight this rank's rows; unchanged without AutoEP on either side.

    Raises:
        CheckpointLayoutError: the tag's ``ds_autoep_layers`` is malformed or does not fit the
            model (one line naming the file and the key).
    """
    layers = state.states.get("ds_autoep_layers")
    where = str(state.model_file)
    if not blocks and layers is None:
        return state
    if not blocks:
        raise CheckpointLayoutError("the checkpoint holds AutoEP blocks (key 'ds_autoep_layers') and this model has "
                                    "none: enable expert_parallel as the saving run did", where)
    if layers is None:
        raise CheckpointLayoutError(f"this model has AutoEP blocks ({blocks[0].path}, ...) and the checkpoint records "
                                    "none (key 'ds_autoep_layers' is missing or None)", where)
    check_metadata(layers, blocks, where)
    keys = sorted({k for st in state.optim.values() for k in st})
    by_key = {k: from_deepspeed(blocks, {n: st[k] for n, st in state.optim.items() if k in st}, where) for k in keys}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for k, named in by_key.items():
        for n, v in named.items():
            optim.setdefault(n, {})[k] = v
    groups = [replace(g, names=names_from_deepspeed(blocks, g.names)) for g in state.groups]
    return replace(state, module=from_deepspeed(blocks, state.module, where), fp32=from_deepspeed(blocks, state.fp32, where),
                   optim=optim, groups=groups)


def _own_file(folder: Path, state: DeepSpeedState, rank: int, stage: int) -> Path:
    """The model-states file DeepSpeed's load names to this rank (its partition's at ZeRO-3, its
    stage's in a pipeline) where the tag has it, else the first."""
    own = folder / (model_states_name(rank) if state.stage == 3 else model_states_name(None, stage))
    return own if own.exists() and (state.stage != 3 or rank < state.world_size) else state.model_file


def load_deepspeed(parts: CheckpointParts, folder: Path, load_module_strict: bool = True,
                   load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                   load_module_only: bool = False, reader: Reader = read_deepspeed) -> tuple[str, dict]:
    """Load the DeepSpeed tag ``folder`` (``find_deepspeed_tag``) into ``parts``; ``reader``:
    ``universal.read_universal`` for a universal checkpoint.

    Returns:
        ``(model-states file, client_state)``, as DeepSpeed's ``load_checkpoint``.
    Raises:
        CheckpointError: a file is missing, truncated or malformed, or the checkpoint does not
            fit the model (names the file or the parameter).

    collective: call on all ranks.
    """
    ck = parts.io
    place = parts.placement
    if place is not None and place.tensors is None and (place.layers is None or place.shape.get("model", 1) > 1):
        raise CheckpointError("loading a DeepSpeed checkpoint into a Megatron-style model-parallel engine (an mpu, "
                              "a pipeline with a model axis) is not supported: only pipelines and AutoTP", str(folder))
    current = parts.zero.state_dict()
    named = global_names(parts.module, current)  # experts by their global number, as the files name them
    trained = [n for g in named["groups"] for n in g["names"]]
    read_optimizer = load_optimizer_states and not load_module_only
    blocks = autoep_blocks(parts.module)
    if blocks and read_optimizer and any(folder.glob("expp_rank_*_optim_states.pt")):
        raise CheckpointError("an AutoEP tag saved without ZeRO: its optimizer state (expp_rank_*_optim_states.pt) is "
                              "not read yet; load with load_optimizer_states=False, or save at ZeRO stage 1 or 2",
                              str(folder))
    state = _autoep(_read(ck, folder, read_optimizer, trained, reader), blocks)
    if place is not None and place.tensors:  # AutoTP: this rank's slices of the whole tensors
        state = _sliced(state, place.tensors)
    source = str(state.model_file)
    held = {n for g in current["groups"] for n in g["names"]}
    weights = localize(parts.module, state.module)
    if place is not None:  # a pipeline stage: the other stages' layers are not in its module
        own = parts.module.state_dict().keys()
        weights = {k: v for k, v in weights.items() if k in own}
    load_module_weights(parts.module, weights, load_module_strict, {}, held, source)
    if read_optimizer:
        whole = _consolidated(state, named, load_module_strict)
        parts.zero.load_state_dict({**whole, "groups": [{**g, "names": live["names"]} for g, live in
                                                        zip(whole["groups"], current["groups"], strict=True)]})
    else:  # masters from the fp32 weights where read (stage 3), else the module's, as DeepSpeed
        parts.zero.load_state_dict(with_masters(current, _masters_from(state.fp32 or state.module, named,
                                                                       folder)))
    if not load_module_only:
        parts.training.load_state_dict(_training(parts, state, load_lr_scheduler_states, load_optimizer_states))
    if ck.comm.rank == 0:
        log.info("loaded DeepSpeed checkpoint %s (saved at data-parallel world size %d, ZeRO stage %d; now %d, "
                 "stage %d)", folder, state.world_size, state.stage, ck.comm.world_size, parts.zero.stage)
    # DeepSpeed's model-parallel rank: the stage in a pipeline, the tensor rank under AutoTP
    mp_rank = place.coord.get("pipe" if place.layers is not None else "model", 0) if place else 0
    client = _client_state(state.states, load_module_only, load_lr_scheduler_states, load_optimizer_states)
    return str(_own_file(folder, state, ck.comm.rank, mp_rank)), client
