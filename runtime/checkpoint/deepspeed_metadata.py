"""What ``DeepSpeedCheckpoint`` keeps of each model-states file it reads once, and checking that
across the files: DeepSpeed's ``model_state_metadata`` and the converter's check of it
(``ds_to_universal._aggregate_autoep_zero12_metadata``).

A model-states file of a DeepSpeed 0.19.8 tag records the saved shape
(``checkpoint_parallel_dimensions``), every parameter's shape (``param_shapes``), and for AutoEP
models the expert layers (``ds_autoep_layers``) and whether data-parallel ranks come before expert
ranks (``ds_config.use_data_before_expert_parallelism``). A malformed or inconsistent tag is named
in one line (AutoEP tags are written and loaded by ``deepspeed_autoep``).
"""

from __future__ import annotations

from typing import Any

from dslaunch.errors import CheckpointLayoutError
from dslaunch.runtime.checkpoint.deepspeed_constants import (
    AUTOEP_EXPERT_KEY_PREFIX,
    AUTOEP_LAYERS_KEY,
    AUTOEP_LAYERS_KEY_LEGACY,
    AUTOEP_ZERO12_REQUIRED_FIELDS,
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    PARAM_SHAPES,
)

__all__ = ["model_state_summary", "aggregate_model_metadata", "USE_DATA_BEFORE_EXPERT_PARALLELISM"]

USE_DATA_BEFORE_EXPERT_PARALLELISM = "use_data_before_expert_parallelism"
_AUTOEP_FIELDS = ("moe_layer_id", "module_path", *AUTOEP_ZERO12_REQUIRED_FIELDS)


def _kind(value: Any) -> Any:
    """What a malformed metadata value is, kept instead of the value (DeepSpeed's summaries)."""
    return type(value).__name__


def model_state_summary(states: dict) -> dict:
    """The metadata of one model-states file that reshaping and conversion need (the rest is
    dropped): the saved shape, every parameter's shape by name, the AutoEP layers' fields, the
    config's expert ordering; a malformed value is kept as its type's name."""
    dims, shapes = states.get(CHECKPOINT_PARALLEL_DIMS), states.get(PARAM_SHAPES)
    if isinstance(dims, dict):
        dims = {key: dims.get(key) for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE)}
    elif dims is not None:
        dims = _kind(dims)
    if isinstance(shapes, (list, tuple)) and all(isinstance(g, dict) for g in shapes):
        shapes = {name: shape for group in shapes for name, shape in group.items()}
    elif shapes is not None:
        shapes = _kind(shapes)
    autoep = states.get(AUTOEP_LAYERS_KEY, states.get(AUTOEP_LAYERS_KEY_LEGACY))
    if isinstance(autoep, list):
        autoep = [{k: e[k] for k in _AUTOEP_FIELDS if k in e} if isinstance(e, dict) else _kind(e) for e in autoep]
    elif autoep is not None:
        autoep = _kind(autoep)
    config = states.get("ds_config", {})
    if isinstance(config, dict):
        ordering = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        config = {USE_DATA_BEFORE_EXPERT_PARALLELISM: ordering if isinstance(ordering, bool) else _kind(ordering)}
    else:
        config = _kind(config)
    return {CHECKPOINT_PARALLEL_DIMS: dims, PARAM_SHAPES: shapes, AUTOEP_LAYERS_KEY: autoep, "ds_config": config}


def aggregate_model_metadata(model_state_metadata: list[tuple[str, dict]]) -> tuple[list[dict], list[dict] | None, bool]:
    """Check the files' summaries against each other: (each file's ``{name: shape}``, the AutoEP
    layers of all files by expert prefix or None, the common expert ordering).

    Raises:
        CheckpointLayoutError: a summary is malformed, or two files disagree (names the files).
    """
    shapes, layers, sources, orderings = [], {}, {}, {}
    for path, meta in model_state_metadata:
        if not isinstance(meta[PARAM_SHAPES], dict):
            raise CheckpointLayoutError(f"{PARAM_SHAPES} must be a list of {{name: shape}} dictionaries", path)
        shapes.append(meta[PARAM_SHAPES])
        autoep = meta[AUTOEP_LAYERS_KEY]
        if autoep is not None and not isinstance(autoep, list):
            raise CheckpointLayoutError("AutoEP metadata must be a list", path)
        for layer in autoep or []:
            prefix = layer.get(AUTOEP_EXPERT_KEY_PREFIX) if isinstance(layer, dict) else None
            if not isinstance(prefix, str) or not prefix:
                raise CheckpointLayoutError(f"AutoEP layer metadata must be dictionaries with a non-empty "
                                            f"{AUTOEP_EXPERT_KEY_PREFIX}", path)
            if layers.setdefault(prefix, layer) != layer:
                raise CheckpointLayoutError(f"conflicting AutoEP metadata for {AUTOEP_EXPERT_KEY_PREFIX} {prefix!r} "
                                            f"in {sources[prefix]} and here", path)
            sources.setdefault(prefix, path)
        config = meta["ds_config"]
        ordering = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM) if isinstance(config, dict) else None
        if not isinstance(ordering, bool):
            raise CheckpointLayoutError(f"ds_config.{USE_DATA_BEFORE_EXPERT_PARALLELISM} must be a boolean", path)
        orderings[path] = ordering
    if len(set(orderings.values())) != 1:
        raise CheckpointLayoutError(f"ds_config.{USE_DATA_BEFORE_EXPERT_PARALLELISM} disagrees across model-state "
                                    f"files: {orderings}")
    return shapes, list(layers.values()) or None, next(iter(orderings.values()))
