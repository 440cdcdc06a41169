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

A tensor-parallel tag (AutoTP training: DeepSpeed's, joined by its ``universal_checkpoint_info``
in ``universal_tp``; dslaunch's, joined by its own slice records) becomes whole tensors, each
``zero/<param>/*.pt`` a dict with DeepSpeed's keys beside the tensor (``cat_dim``,
``sub_param_shape``, ...), so both dslaunch (any tensor-parallel degree, 1 included) and
DeepSpeed's restore cut it again. Restoring single parameters: ``universal_restore``.

A DeepSpeed-format AutoEP tag (ZeRO-1/2, or ZeRO-3's ``zero3_partitioned``) becomes each block's
expert weights whole (``zero/<block>.experts.w1/fp32.pt``: ``{"param": [num_experts, ...], "cat_dim":
0, "is_expert_param": True, "ep_num_experts": ...}``, as DeepSpeed's ``autoep_universal`` writes
them), which load at any ``autoep_size`` (``deepspeed_autoep``); from a ZeRO-3 AutoEP tag the dense
parameters' files are bare flat tensors and no ``step.pt`` is written (the step is in
``optimizer_state.pt``), as DeepSpeed's ZeRO-3 conversion writes them.

An AutoEP tag in dslaunch's own layout converts the same way (``universal_autoep``: its save records
the blocks, the conversion joins the expert ranks' rows and writes DeepSpeed's names and records).

Limitations: no pipeline parallelism, no ``deepspeed.moe`` experts; ``convert`` reads the whole fp32
state into host memory.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from dslaunch import safe_write
from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.autotp_universal import SubparamShape
from dslaunch.runtime.checkpoint.checkpointer import MODULE_FILE, rank_file, zero_file
from dslaunch.runtime.checkpoint.deepspeed_autoep import join_expert_ranks
from dslaunch.runtime.checkpoint.deepspeed_constants import (
    CAT_DIM,
    ORIGINAL_VOCAB_SIZE,
    PADDED_VOCAB_SIZE,
    PARAM,
    PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PIPELINE_REPLICATED_PARAMETER_PATTERNS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    VOCABULARY_PARAMETER_PATTERNS,
)
from dslaunch.runtime.checkpoint.deepspeed_layout import is_pipeline, model_states_name, tag_folder_format
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
from dslaunch.runtime.checkpoint.universal_autoep import expert_extras
from dslaunch.runtime.checkpoint.universal_restore import (
    enable_universal_checkpoint,
    load_hp_checkpoint_state,
    load_state,
)
from dslaunch.runtime.checkpoint.universal_tp import read_tensor_parallel_whole, stored, tp_degree

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


def _tensor(path: Path, shape: tuple[int, ...], sliced: bool) -> torch.Tensor:
    """One ``zero/<param>/<state>.pt``: the whole tensor, checked against the parameter's shape
    (``sliced``: the model states were saved tensor-parallel, so they give one rank's slice shape
    and the file's own, of as many dimensions, is the whole one)."""
    obj, extra = load_state(path)
    if (sliced or extra.get("is_expert_param")) and obj.numel() != math.prod(shape) and obj.dim() == len(shape):
        return obj.float().clone()  # AutoEP: every expert's rows (the model states give one rank's)
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
    dims = states.get("checkpoint_parallel_dimensions") or {}
    sliced = int(dims.get("tp_degree", states.get("mp_world_size", 1)) or 1) > 1
    for g, group_shapes in enumerate(shapes):
        names = list(group_shapes)
        for name, shape in group_shapes.items():
            base = folder / ZERO_FOLDER / name
            fp32[name] = _tensor(base / "fp32.pt", tuple(shape), sliced)
            optim[name] = ({k: _tensor(base / f"{k}.pt", tuple(fp32[name].shape), False) for k in _STATES[1:]}
                           if optimizer else {})
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


def _whole(store: CheckpointStore, tag: str, manifest: Any, src: Path
           ) -> tuple[dict, dict[str, Any], dict[str, tuple[int, bool]], int]:
    """A dslaunch tag's whole strategy state, module, AutoTP cuts (``model_parallel.whole_autotp``;
    none for a data-parallel tag) and data-parallel size."""
    meta = manifest.meta
    if "model_parallel" in meta:
        from dslaunch.runtime.checkpoint.model_parallel import whole_autotp

        autotp = whole_autotp(store, tag, manifest)
        if autotp is None:
            raise CheckpointError("holds pipeline or mpu model-parallel parameters: not convertible to a universal "
                                  "checkpoint (only AutoTP and data-parallel tags are)", str(src))
        shape = meta["model_parallel"]["shape"]
        return *autotp, int(shape.get("data", 1))
    if expert_groups(meta["partition"]):  # AutoEP: every expert's rows joined, in DeepSpeed's names
        from dslaunch.runtime.checkpoint.universal_autoep import blocks_of, whole_groups

        groups = whole_groups(lambda r: store.read(tag, zero_file(r), manifest), meta, blocks_of(meta, str(src)),
                              str(src))
        return {"groups": groups}, dict(store.read(tag, MODULE_FILE, manifest)["module"]), {}, int(meta["world_size"])
    pmap = meta["partition"]
    full = [(0, int(g["numel"])) for g in pmap["groups"]]
    whole = assemble([store.read(tag, zero_file(r), manifest) for r in needed_ranks(pmap, full)], full)
    return whole, dict(store.read(tag, MODULE_FILE, manifest)["module"]), {}, int(meta["world_size"])


def _param(flat: torch.Tensor, offset: int, shape: Any, transposed: bool) -> torch.Tensor:
    """One parameter of a flat group, fp32, in the model's own layout (GPT-2's Conv1D: ``[in, out]``)."""
    t = flat[offset:offset + math.prod(shape)].float().view(tuple(shape))
    return (t.t() if transposed else t).contiguous().clone()


def _autoep_states(meta: dict, module: dict, fp32: dict, order: list[str], shapes: list, states: dict,
                   where: str) -> tuple[OrderedDict, list]:
    """An AutoEP tag's universal model states (``universal_autoep.model_states``) into ``states``;
    its module in DeepSpeed's names, and its blocks."""
    from dslaunch.runtime.checkpoint.deepspeed_autoep import from_deepspeed
    from dslaunch.runtime.checkpoint.universal_autoep import blocks_of, model_states

    blocks = blocks_of(meta, where)
    ours = {**module, **from_deepspeed(blocks, fp32, where, local=False)}
    extra = model_states(blocks, OrderedDict((k, ours[k]) for k in order if k in ours), shapes,
                         int(meta["zero_stage"]))
    states.update({k: v for k, v in extra.items() if k != "module"})
    return extra["module"], blocks


def _read_dslaunch(src: Path) -> tuple[DeepSpeedState, dict[str, bytes], dict[str, dict]]:
    """A tag in dslaunch's own layout, whole (AutoTP slices joined, in the model's own layout), the
    model-states files DeepSpeed loads a universal checkpoint with: ``mp_rank_00_model_states.pt``
    (ZeRO 1/2: whole weights) and ``zero_pp_rank_0_mp_rank_00_model_states.pt`` (ZeRO-3:
    placeholders for the trained ones), and each sliced parameter's ``cat_dim``."""
    store, tag = CheckpointStore(src.parent), src.name
    manifest = store.manifest(tag)
    meta = manifest.meta
    check_meta(meta, str(src / MANIFEST))
    whole, module, cuts, dp_size = _whole(store, tag, manifest, src)
    training = store.read(tag, rank_file(0), manifest)
    fp32, optim, groups, shapes = {}, {}, [], []
    extras: dict[str, dict] = {}
    for g in whole["groups"]:
        offset, group_shapes = 0, OrderedDict()
        for name, shape in zip(g["names"], g["shapes"], strict=True):
            dim, transposed = cuts.get(name, (None, False))
            fp32[name] = _param(g["master"], offset, shape, transposed)
            optim[name] = {k: _param(v, offset, shape, transposed) for k, v in g["optim_state"].items()}
            group_shapes[name] = torch.Size(fp32[name].shape)
            if dim is not None:
                extras[name] = {CAT_DIM: 1 - dim if transposed else dim}
            offset += math.prod(shape)
        shapes.append(group_shapes)
        groups.append(DeepSpeedGroup(list(g["names"]), dict(g["optim_scalars"]), dict(g["hparams"])))
    dtypes = {k: getattr(torch, v["dtype"]) for k, v in meta.get("module", {}).items()}
    weights = {**module, **{k: v.to(dtypes.get(k, torch.float32)) for k, v in fp32.items()}}
    order = meta.get("module_keys") or list(weights)
    engine = training["engine"]
    states = {"buffer_names": [], "optimizer": None, "param_shapes": shapes,
              "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
              "lr_scheduler": engine.get("lr_scheduler"), "data_sampler": None, "random_ltd": None,
              "skipped_steps": int(engine["skipped_steps"]), "global_steps": int(engine["global_steps"]),
              "global_samples": int(engine["global_samples"]), "dp_world_size": dp_size,
              "mp_world_size": 1, "ds_config": {}, "ds_version": DEEPSPEED_VERSION, **training.get("client_state", {})}
    whole_module = OrderedDict((k, weights[k]) for k in order if k in weights)
    if meta.get("autoep") and expert_groups(meta["partition"]):  # DeepSpeed's names, its AutoEP records
        whole_module, blocks = _autoep_states(meta, module, fp32, order, shapes, states, str(src))
        extras.update(expert_extras(blocks))
    placeholders = OrderedDict((k, torch.empty(0, dtype=v.dtype) if k in fp32 or k not in weights else v)
                               for k, v in whole_module.items())
    files = {model_states_name(): to_bytes({"module": whole_module, **states}),
             model_states_name(0): to_bytes({"module": placeholders, **states})}
    state = DeepSpeedState(src, src / MODULE_FILE, int(meta["zero_stage"]), dp_size, states,
                           whole_module, fp32, optim, groups)
    return state, files, extras


def _flat_dense(state: DeepSpeedState) -> bool:
    """A ZeRO-3 AutoEP tag (``zero3_partitioned``): DeepSpeed's ``ds_to_universal`` stores its dense
    parameters as bare flat tensors (its ZeRO-3 merge), which its AutoEP tests and loaders expect."""
    from dslaunch.runtime.checkpoint.deepspeed_autoep_zero3 import FORMAT

    layers = state.states.get("ds_autoep_layers")
    return state.stage == 3 and isinstance(layers, list) and any(
        isinstance(e, dict) and e.get("checkpoint_format") == FORMAT for e in layers)


def convert(input_folder: str | Path, output_folder: str | Path, strict: bool = True) -> Path:
    """Write the universal layout of the tag ``input_folder`` (DeepSpeed's format or dslaunch's,
    data- or tensor-parallel) into ``output_folder``, and ``latest_universal`` beside it naming it
    (DeepSpeed's ``ds_to_universal``).

    Args:
        strict: a DeepSpeed AutoTP tag's ``universal_checkpoint_info`` patterns must each name a
            parameter (DeepSpeed's ``--no_strict`` turns this off).
    Raises:
        CheckpointError: the input is no checkpoint tag, a file is missing or malformed (names it),
            the slice records do not describe the slices, or a write failed;
        UnconvertibleLayoutError: a layer of a DeepSpeed AutoTP tag could not describe its split.
    """
    src, out = Path(input_folder), Path(output_folder)
    extras: dict[str, dict] = {}
    if tag_folder_format(src) == "deepspeed":
        if tp_degree(src) > 1 and not is_pipeline(src):
            state, extras = read_tensor_parallel_whole(src, strict)
        else:
            state = read_deepspeed(src)
        if isinstance(state.states.get("ds_autoep_layers"), list):  # AutoEP: each block's experts whole
            state, extras = join_expert_ranks(state)
        model_files = {f.name: f.read_bytes() for f in sorted(src.glob("*model_states.pt"))}
    else:
        state, model_files, extras = _read_dslaunch(src)
    if state.stage == 0:
        raise CheckpointError("holds no ZeRO optimizer files (ZeRO stage 0): universal checkpoints are made "
                              "from ZeRO checkpoints", str(src))
    raw = _flat_dense(state)
    try:
        for g in state.groups:
            for name in g.names:
                where = out / ZERO_FOLDER / name
                safe_write.make_dirs(where)
                tensors = {"fp32": state.fp32[name], **state.optim.get(name, {})}
                for key, t in tensors.items():
                    data = to_bytes(t.reshape(-1).contiguous()) if raw and name not in extras else \
                        stored(t, extras.get(name, {}))
                    safe_write.write_file(where, f"{key}.pt", data)
                if "step" in g.scalars and not raw:  # DeepSpeed's ZeRO-3 conversion keeps it in optimizer_state.pt only
                    safe_write.write_file(where, "step.pt", to_bytes(_as_step(g.scalars["step"])))
        safe_write.write_file(out / ZERO_FOLDER, OPTIMIZER_STATE, to_bytes(_optimizer_state(state)))
        for name, data in model_files.items():
            safe_write.write_file(out, name, data)
        safe_write.write_file(out.parent, LATEST_UNIVERSAL, out.name)
    except OSError as exc:
        raise CheckpointError(f"cannot write the universal checkpoint: {safe_write.explain(exc, out)}") from None
    return out
