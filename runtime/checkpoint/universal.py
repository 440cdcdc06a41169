"""DeepSpeed's universal checkpoints: read (``"checkpoint": {"load_universal": true}``) and written
(``dslaunch ds-to-universal``).

A universal tag folder (what DeepSpeed's ``ds_to_universal --output_folder`` makes; the file
``latest_universal`` beside it names it) holds every trained parameter whole, so any world size
and ZeRO stage can load it::

    zero/<param name>/fp32.pt        the fp32 master: a tensor, or {"param": tensor, ...}
    zero/<param name>/exp_avg.pt     the optimizer's per-element state, the same way
    zero/<param name>/exp_avg_sq.pt
    zero/<param name>/step.pt        (optional) the optimizer's step
    zero/optimizer_state.pt          the optimizer's global state and ``param_groups``
    *model_states.pt                 the source's model-states files (module, counters, scheduler)

``read_universal`` turns such a folder into ``deepspeed_read.DeepSpeedState``, which
``deepspeed_load`` places at the engine's world size and stage; ``convert`` writes the layout from
a DeepSpeed-format tag (DeepSpeed's or dslaunch's ``format: deepspeed``; its model-states files
copied, as ``ds_to_universal`` does) or a tag in dslaunch's own layout (model-states files for
DeepSpeed's ZeRO-1/2 and ZeRO-3 loaders made from it). Writes go through ``safe_write``; DeepSpeed's classes by name
(``deepspeed_pickle``).

Limitations: no tensor or pipeline parallelism (the ``universal_checkpoint_info`` patterns that
merge TP slices), no MoE experts, no vocabulary padding; ``convert`` reads the whole fp32 state
into host memory.
"""

from __future__ import annotations

import math
import types
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dslaunch import safe_write
from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.checkpointer import MODULE_FILE, rank_file, zero_file
from dslaunch.runtime.checkpoint.deepspeed_constants import (
    CAT_DIM,
    ORIGINAL_VOCAB_SIZE,
    PADDED_VOCAB_SIZE,
    PARAM,
    PARAM_N_SUB_PARAMS,
    PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PIPELINE_REPLICATED_PARAMETER_PATTERNS,
    SUB_PARAM_SHAPE,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    VOCABULARY_PARAMETER_PATTERNS,
)
from dslaunch.runtime.checkpoint.deepspeed_layout import model_states_name, tag_folder_format
from dslaunch.runtime.checkpoint.deepspeed_pickle import loss_scaler, to_bytes
from dslaunch.runtime.checkpoint.deepspeed_read import (
    DeepSpeedGroup,
    DeepSpeedState,
    read_deepspeed,
    read_file,
)
from dslaunch.runtime.checkpoint.deepspeed_write import DEEPSPEED_VERSION
from dslaunch.runtime.checkpoint.reshard import assemble, check_meta, expert_groups, needed_ranks
from dslaunch.runtime.checkpoint.store import MANIFEST, CheckpointStore

__all__ = ["UNIVERSAL_CHECKPOINT_INFO", "UNIVERSAL_CHECKPOINT_VERSION_KEY", "UNIVERSAL_CHECKPOINT_VERSION_VALUE",
           "VOCABULARY_PARAMETER_PATTERNS", "PIPELINE_REPLICATED_PARAMETER_PATTERNS",
           "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS", "TP_REPLICATED_PARAMETER_PATTERNS",
           "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0", "PADDED_VOCAB_SIZE", "ORIGINAL_VOCAB_SIZE",
           "LATEST_UNIVERSAL", "ZERO_FOLDER", "OPTIMIZER_STATE", "PARAM", "universal_tag", "read_universal", "convert",
           "SubparamShape", "load_hp_checkpoint_state", "enable_universal_checkpoint"]


LATEST_UNIVERSAL = "latest_universal"
ZERO_FOLDER = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def universal_tag(load_dir: str | Path, tag: Any) -> Path:
    """The universal tag folder to load: ``tag``, or the one ``load_dir/latest_universal`` names.

    Raises:
        CheckpointError: no such tag, or the folder has no ``zero/`` (not a universal checkpoint).
    """
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST_UNIVERSAL
        try:
            tag = latest.read_text().strip()
        except (OSError, UnicodeDecodeError):
            raise CheckpointError("missing or unreadable: checkpoint.load_universal loads the tag this file names "
                                  "(make one with `dslaunch ds-to-universal`), or pass tag=", str(latest)) from None
    folder = root / str(tag)
    if not (folder / ZERO_FOLDER).is_dir():
        raise CheckpointError(f"not a universal checkpoint (no {ZERO_FOLDER}/ folder): convert it with "
                              "`dslaunch ds-to-universal`, or set checkpoint.load_universal false", str(folder))
    return folder


def _model_file(folder: Path) -> Path:
    for name in (model_states_name(), model_states_name(0)):
        if (folder / name).is_file():
            return folder / name
    raise CheckpointError(f"has neither {model_states_name()} nor {model_states_name(0)}: not a DeepSpeed "
                          "checkpoint tag", str(folder))


def _load_state(path: Path) -> tuple[torch.Tensor, dict]:
    """One ``zero/<param>/<state>.pt``: its tensor, and the dict around it (empty for a bare tensor)."""
    obj: Any
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError("missing: the universal checkpoint has no such file for this parameter",
                              str(path)) from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"unreadable or truncated ({type(exc).__name__}: {str(exc)[:200]})", str(path)) from None
    info = obj if isinstance(obj, dict) else {}
    tensor = obj.get(PARAM) if isinstance(obj, dict) else obj
    if not torch.is_tensor(tensor):
        raise CheckpointError(f"holds no tensor (expected a tensor or {{{PARAM!r}: tensor}})", str(path))
    return tensor, info


def _tensor(path: Path, shape: tuple[int, ...]) -> torch.Tensor:
    """One ``zero/<param>/<state>.pt``: the whole tensor, checked against the parameter's shape."""
    obj, _ = _load_state(path)
    if obj.numel() != math.prod(shape):
        raise CheckpointError(f"holds {tuple(obj.shape)} ({obj.numel()} elements), the parameter is {shape}",
                              str(path))
    return obj.reshape(shape).float().clone()


def _step(folder: Path, name: str, osd: dict) -> Any:
    step_file = folder / ZERO_FOLDER / name / "step.pt"
    if step_file.is_file():
        return torch.load(step_file, map_location="cpu", weights_only=True)
    inner = osd.get("optimizer_state_dict") or {}
    return ((inner.get("state") or {}).get(0) or {}).get("step")


def read_universal(folder: Path, optimizer: bool = True, trained: list[str] | None = None) -> DeepSpeedState:
    """Read the universal tag ``folder`` (``optimizer`` False: the moments are not read).

    Raises:
        CheckpointError: a file is missing, unreadable, or of another shape than the model states
            say (names the file).
    """
    model_file = _model_file(folder)
    states = read_file(model_file)
    shapes = states.get("param_shapes")
    if not (isinstance(shapes, list) and all(isinstance(s, dict) for s in shapes)):
        raise CheckpointError("key 'param_shapes' is missing or not a list of {name: shape}: not a ZeRO "
                              "checkpoint's model states", str(model_file))
    osd = read_file(folder / ZERO_FOLDER / OPTIMIZER_STATE)
    param_groups = osd.get("param_groups") or (osd.get("optimizer_state_dict") or {}).get("param_groups") or []
    fp32: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    groups = []
    for g, group_shapes in enumerate(shapes):
        names = list(group_shapes)
        for name, shape in group_shapes.items():
            base = folder / ZERO_FOLDER / name
            fp32[name] = _tensor(base / "fp32.pt", tuple(shape))
            optim[name] = {k: _tensor(base / f"{k}.pt", tuple(shape)) for k in _STATES[1:]} if optimizer else {}
        step = _step(folder, names[0], osd) if names else None
        hparams = {k: v for k, v in (param_groups[g] if g < len(param_groups) else {}).items() if k != "params"}
        groups.append(DeepSpeedGroup(names, {"step": step} if step is not None else {}, hparams))
    module = {**states["module"], **fp32}
    stage = osd.get("zero_stage", 3 if model_file.name == model_states_name(0) else 2)
    stage = int(getattr(stage, "args", (stage,))[0]) if not isinstance(stage, int) else stage
    return DeepSpeedState(folder, model_file, stage, int(states.get("dp_world_size", 1)), states, module, fp32,
                          optim, groups)


def _optimizer_state(state: DeepSpeedState) -> dict:
    """``zero/optimizer_state.pt``: what both DeepSpeed loaders read (stage 3 its nested copy)."""
    param_groups = [{**g.hparams, "params": [i]} for i, g in enumerate(state.groups)]
    steps = {i: {"step": _as_step(g.scalars["step"])} for i, g in enumerate(state.groups) if "step" in g.scalars}
    return {"zero_stage": state.stage, "loss_scaler": loss_scaler(), "dynamic_loss_scale": False, "overflow": False,
            "partition_count": state.world_size, "ds_version": DEEPSPEED_VERSION,
            "optimizer_state_dict": {"state": steps, "param_groups": param_groups}, "param_groups": param_groups}


def _as_step(step: Any) -> torch.Tensor:
    return step.detach().clone().float() if torch.is_tensor(step) else torch.tensor(float(step))


def _read_dslaunch(src: Path) -> tuple[DeepSpeedState, dict[str, bytes]]:
    """A tag in dslaunch's own layout, whole, and the model-states files DeepSpeed loads a universal
    checkpoint with: ``mp_rank_00_model_states.pt`` (ZeRO 1/2: whole weights) and
    ``zero_pp_rank_0_mp_rank_00_model_states.pt`` (ZeRO-3: placeholders for the trained ones)."""
    store, tag = CheckpointStore(src.parent), src.name
    manifest = store.manifest(tag)
    meta = manifest.meta
    check_meta(meta, str(src / MANIFEST))
    if "model_parallel" in meta or expert_groups(meta["partition"]):
        raise CheckpointError("holds pipeline, tensor-parallel or expert parameters: not convertible to a "
                              "universal checkpoint yet", str(src))
    pmap = meta["partition"]
    full = [(0, int(g["numel"])) for g in pmap["groups"]]
    whole = assemble([store.read(tag, zero_file(r), manifest) for r in needed_ranks(pmap, full)], full)
    training = store.read(tag, rank_file(0), manifest)
    module = dict(store.read(tag, MODULE_FILE, manifest)["module"])
    fp32, optim, groups = {}, {}, []
    for g in whole["groups"]:
        offset = 0
        for name, shape in zip(g["names"], g["shapes"], strict=True):
            n = math.prod(shape)
            fp32[name] = g["master"][offset:offset + n].float().view(tuple(shape)).clone()
            optim[name] = {k: v[offset:offset + n].float().view(tuple(shape)).clone()
                           for k, v in g["optim_state"].items()}
            offset += n
        groups.append(DeepSpeedGroup(list(g["names"]), dict(g["optim_scalars"]), dict(g["hparams"])))
    dtypes = {k: getattr(torch, v["dtype"]) for k, v in meta.get("module", {}).items()}
    weights = {**module, **{k: v.to(dtypes.get(k, torch.float32)) for k, v in fp32.items()}}
    order = meta.get("module_keys") or list(weights)
    engine = training["engine"]
    states = {"buffer_names": [], "optimizer": None,
              "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in zip(g["names"], g["shapes"], strict=True))
                               for g in whole["groups"]],
              "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
              "lr_scheduler": engine.get("lr_scheduler"), "data_sampler": None, "random_ltd": None,
              "skipped_steps": int(engine["skipped_steps"]), "global_steps": int(engine["global_steps"]),
              "global_samples": int(engine["global_samples"]), "dp_world_size": int(meta["world_size"]),
              "mp_world_size": 1, "ds_config": {}, "ds_version": DEEPSPEED_VERSION, **training.get("client_state", {})}
    whole_module = OrderedDict((k, weights[k]) for k in order if k in weights)
    placeholders = OrderedDict((k, torch.empty(0, dtype=v.dtype) if k in fp32 else v) for k, v in whole_module.items())
    files = {model_states_name(): to_bytes({"module": whole_module, **states}),
             model_states_name(0): to_bytes({"module": placeholders, **states})}
    state = DeepSpeedState(src, src / MODULE_FILE, int(meta["zero_stage"]), int(meta["world_size"]), states,
                           whole_module, fp32, optim, groups)
    return state, files


def convert(input_folder: str | Path, output_folder: str | Path) -> Path:
    """Write the universal layout of the DeepSpeed-format tag ``input_folder`` into
    ``output_folder``, and ``latest_universal`` beside it naming it (DeepSpeed's ``ds_to_universal``).

    Raises:
        CheckpointError: the input is no DeepSpeed-format tag (a dslaunch one, or neither), a file is
            missing or malformed (names it), or a write failed.
    """
    src, out = Path(input_folder), Path(output_folder)
    if tag_folder_format(src) == "deepspeed":
        state = read_deepspeed(src)
        model_files = {f.name: f.read_bytes() for f in sorted(src.glob("*model_states.pt"))}
    else:
        state, model_files = _read_dslaunch(src)
    if state.stage == 0:
        raise CheckpointError("holds no ZeRO optimizer files (ZeRO stage 0): universal checkpoints are made "
                              "from ZeRO checkpoints", str(src))
    try:
        for g in state.groups:
            for name in g.names:
                where = out / ZERO_FOLDER / name
                safe_write.make_dirs(where)
                tensors = {"fp32": state.fp32[name], **state.optim.get(name, {})}
                for key, t in tensors.items():
                    safe_write.write_file(where, f"{key}.pt", to_bytes({PARAM: t.contiguous()}))
                if "step" in g.scalars:
                    safe_write.write_file(where, "step.pt", to_bytes(_as_step(g.scalars["step"])))
        safe_write.write_file(out / ZERO_FOLDER, OPTIMIZER_STATE, to_bytes(_optimizer_state(state)))
        for name, data in model_files.items():
            safe_write.write_file(out, name, data)
        safe_write.write_file(out.parent, LATEST_UNIVERSAL, out.name)
    except OSError as exc:
        raise CheckpointError(f"cannot write the universal checkpoint: {safe_write.explain(exc, out)}") from None
    return out


@dataclass(frozen=True)
class SubparamShape:
    """DeepSpeed's description of a parameter made of sub-parameters (a fused QKV): the ``patterns``
    of the names it applies to, each sub-parameter's ``shape`` and the dimension TP cuts
    (``partition_dim``). Megatron-DeepSpeed puts these in ``universal_checkpoint_info``."""

    patterns: list[str]
    shape: tuple[tuple[int, ...] | int, ...]
    partition_dim: int


def load_hp_checkpoint_state(param: torch.nn.Parameter, folder: str | Path, tp_rank: int = 0, tp_world_size: int = 1,
                             ep_rank: int = 0, ep_size: int = 1) -> Any:
    """Load ``param`` from its universal folder ``folder`` (``zero/<param name>/``): ``fp32.pt``,
    whole, or this tensor rank's slice along the file's ``cat_dim`` (default 0). Returns what
    ``step.pt`` holds (None without one).

    Raises:
        CheckpointError: the file is missing or does not hold ``param``'s shape (names it);
        NotInDslaunchError: a slice of sub-parameters (``sub_param_shape``) or of experts.
    """
    from dslaunch.errors import NotInDslaunchError

    path = Path(folder) / "fp32.pt"
    full, info = _load_state(path)
    if info.get(SUB_PARAM_SHAPE) is not None or info.get(PARAM_N_SUB_PARAMS) is not None or ep_size > 1:
        raise NotInDslaunchError(f"{path}: loading one tensor rank's slice of fused sub-parameters or of experts "
                                 "is not in dslaunch: load the universal tag with load_checkpoint")
    if tuple(full.shape) != tuple(param.shape):
        dim = int(info.get(CAT_DIM, 0))
        parts = full.chunk(tp_world_size, dim) if full.dim() > dim else ()
        if len(parts) != tp_world_size or tuple(parts[tp_rank].shape) != tuple(param.shape):
            raise CheckpointError(f"holds {tuple(full.shape)}, which is not the parameter's {tuple(param.shape)} "
                                  f"whole or cut in {tp_world_size} along dim {dim}", str(path))
        full = parts[tp_rank]
    with torch.no_grad():
        param.copy_(full.to(param.dtype))
    step = Path(folder) / "step.pt"
    return torch.load(step, map_location="cpu", weights_only=True) if step.is_file() else None


def enable_universal_checkpoint(param_list: list[torch.nn.Parameter]) -> None:
    """Give each parameter ``load_hp_checkpoint_state(folder, tp_rank, tp_world_size)``
    (``load_hp_checkpoint_state`` bound to it), as DeepSpeed's optimizers do before loading a
    universal tag. dslaunch's engine loads universal tags itself (``load_universal``); this is for
    scripts that load single parameters from one."""
    for param in param_list:
        param.load_hp_checkpoint_state = types.MethodType(load_hp_checkpoint_state, param)
