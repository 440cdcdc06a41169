"""DeepSpeed's pipeline checkpoints (``PipelineModule``): read whole, and what differs in writing them.

Owns what is particular to a pipeline's tag (names in ``deepspeed_layout``): stage S has the files of
a plain ZeRO checkpoint under ``mp_rank_SS`` (its model states, with ``module`` None and
``mp_world_size`` the stage count; each data-parallel rank's optimizer file of its stage's
parameters), and every layer with weights has ``layer_XX-model_states.pt`` (its ``state_dict()``,
from data-parallel rank 0 of its stage). Parameters are named as DeepSpeed's and dslaunch's
``PipelineModule`` name them (``<layer>.<param>``, ``tied_modules.<key>.<param>``), which are the
names of an ``nn.Sequential`` of the same layers: a pipeline tag loads by name at any stage count or
data-parallel size, and into a plain engine. ``deepspeed_write`` writes a stage's files with
``stage_states`` and ``layer_files``.

Limitations: loading, ZeRO stage 1 or DeepSpeed's bf16 optimizer (DeepSpeed's pipelines run at stages
0 and 1; a bf16 stage 0's ``BF16_Optimizer`` files name their parameters, ``deepspeed_bf16``; a
16-bit or fp32 stage 0's optimizer state numbers the parameters of one stage only: load it with
``load_optimizer_states=False``);
no tensor axis in the pipeline (``layer_XX-model_YY-...``) either way.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.deepspeed_layout import layer_name, model_states_name
from dslaunch.runtime.checkpoint.deepspeed_read import DeepSpeedState, read_file, read_part
from dslaunch.runtime.checkpoint.model_parallel import Placement

__all__ = ["read_pipeline", "stages_of", "stage_states", "layer_files"]

_LAYER = re.compile(r"layer_(\d+)-model_states\.pt")


def stages_of(folder: Path) -> int:
    """The stage count the tag was saved with (``mp_world_size`` of stage 0's model states), every
    stage's model states present.

    Raises:
        CheckpointError: a tensor axis, or a stage's file missing.
    """
    first = folder / model_states_name(None, 0)
    states = read_file(first)
    dims = states.get("checkpoint_parallel_dimensions") or {}
    stages, tensor = int(dims.get("pp_degree", states.get("mp_world_size", 1))), int(dims.get("tp_degree", 1))
    if tensor != 1 or list(folder.glob("layer_*-model_*-model_states.pt")):
        raise CheckpointError(f"a pipeline with tensor parallelism (tp_degree {tensor}) cannot be loaded: only "
                              "pipelines of whole layers", str(folder))
    missing = [model_states_name(None, s) for s in range(stages) if not (folder / model_states_name(None, s)).exists()]
    if missing:
        raise CheckpointError(f"the pipeline was saved with {stages} stages (pp_degree) but {missing[:3]} are "
                              "missing", str(folder))
    return stages


def _layers(folder: Path) -> dict:
    """Every layer file's weights, under ``<layer index>.``."""
    out = {}
    for path in sorted(folder.glob("layer_*-model_states.pt")):
        found = _LAYER.fullmatch(path.name)
        if found is None:
            continue
        out.update({f"{int(found[1])}.{k}": v for k, v in read_file(path).items()})
    return out


def _check_layers(folder: Path, parts: list[DeepSpeedState], module: dict) -> None:
    """Every layer whose parameters a stage trains has its file."""
    names = [n for p in parts for shapes in p.states.get("param_shapes") or [] for n in shapes]
    names += [n for p in parts for n in p.fp32]  # a stage-0 bf16 tag: from its optimizer files
    layers = {int(n.split(".", 1)[0]) for n in names if n.split(".", 1)[0].isdigit()}
    missing = [layer_name(i) for i in sorted(layers) if not any(k.startswith(f"{i}.") for k in module)]
    if missing:
        raise CheckpointError(f"the pipeline's stages train layers {sorted(layers)} but {missing[:3]} are missing",
                              str(folder))


def read_pipeline(folder: Path, optimizer: bool = True, trained: list[str] | None = None) -> DeepSpeedState:
    """``deepspeed_read.read_deepspeed`` of a pipeline's tag: every stage's state, joined by name.

    Raises:
        CheckpointError: a stage's or layer's file missing or broken (names it), a tensor axis, or
            optimizer state of a pipeline without ZeRO.
    """
    stages = stages_of(folder)
    parts = [read_part(folder, optimizer, None, s) for s in range(stages)]
    if optimizer and parts[0].stage == 0 and parts[0].states.get("optimizer") is not None:
        raise CheckpointError("a DeepSpeed pipeline without ZeRO numbers each stage's optimizer state by position "
                              "only: load it with load_optimizer_states=False, or save at ZeRO stage 1",
                              str(folder))
    layers = _layers(folder)
    _check_layers(folder, parts, layers)
    module = {**layers, **{k: v for p in parts for k, v in p.module.items()}}
    joined = parts[0]
    for p in parts[1:]:
        joined = replace(joined, fp32={**joined.fp32, **p.fp32}, optim={**joined.optim, **p.optim},
                         groups=joined.groups + p.groups)
    return _shaped(replace(joined, module=module), layers)


def _shaped(state: DeepSpeedState, layers: dict[str, torch.Tensor]) -> DeepSpeedState:
    """Masters, moments and weights in their layers' shapes: a stage-0 ``BF16_Optimizer`` tag names
    its parameters' sizes only (``deepspeed_bf16``), the layer files have their shapes."""
    def shape(name: str, t: torch.Tensor) -> torch.Tensor:
        known = layers.get(name)
        return t.view(known.shape) if known is not None and known.numel() == t.numel() else t

    return replace(state, fp32={n: shape(n, t) for n, t in state.fp32.items()},
                   module={n: shape(n, t) for n, t in state.module.items()},
                   optim={n: {k: shape(n, t) for k, t in m.items()} for n, m in state.optim.items()})


def stage_states(states: dict, place: Placement) -> dict:
    """A plain tag's model states (``deepspeed_write``) as stage ``place``'s: no ``module`` (the layer
    files hold it), the stage count as the model-parallel size."""
    stages = place.shape.get("pipe", 1)
    return {**states, "module": None, "mp_world_size": stages,
            "checkpoint_parallel_dimensions": {"pp_degree": stages, "tp_degree": 1}}


def layer_files(module_sd: dict[str, Any], place: Placement) -> dict[str, dict]:
    """``layer_XX-model_states.pt`` of each layer on this stage: its keys less the layer's prefix
    (a layer without weights gets an empty file, as DeepSpeed writes one)."""
    assert place.layers is not None
    return {layer_name(idx): {k[len(prefix):]: v for k, v in module_sd.items() if k.startswith(prefix)}
            for idx, prefix in sorted(place.layers.items())}
