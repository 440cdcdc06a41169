"""Where DeepSpeed 0.19.8's AutoTP training cuts each parameter, and the slice map it records.

Owns the cut a DeepSpeed job would make of the same model (``deepspeed_tp_write`` writes each
tensor rank's slices by it, re-cut from the whole, whatever dslaunch's own planner chose) and
``universal_checkpoint_info`` describing it. DeepSpeed's heuristic AutoTP (a model with no
Hugging Face ``tp_plan`` nor ``partition_config``) picks layers by name, not by dataflow:

- the transformer blocks are the classes of the modules in the model's ``nn.ModuleList``\\ s; in
  each block every ``Linear`` is cut, the others (embeddings, norms, ``lm_head`` outside the
  blocks) stay whole on every rank, where dslaunch's planner splits the vocabulary;
- a block's row-parallel layers (``LinearAllreduce``: the weight cut on dim 1, the bias whole) are
  those named ``o_proj``, ``out_proj``, ``down_proj`` and the layer just before a ``LayerNorm``
  in the block's module order; every other ``Linear`` is column-parallel (weight and bias cut on
  dim 0). Each name is DeepSpeed's short one (``<parent>.<child>``);
- the sizes are ``tensor_parallel.split.get_shard_size_list`` (by KV heads when the model's config
  gives them and the layer is no MLP's, else near even in units of ``tp_grain_size``).

Anything DeepSpeed cuts another way is refused in one line naming the layer (``CheckpointError``):
a fused QKV or gate/up layer, an embedding inside a block, the models DeepSpeed special-cases by
class name, a Hugging Face ``tp_plan``, ``partition_config``, the vocabulary-parallel head and a
script's hand-built ``LinearLayer`` / ``LinearAllreduce`` (DeepSpeed keeps those as built).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.deepspeed_constants import (
    AFFINE_MAP,
    AFFINE_MAP_PARAMS,
    AFFINE_MAP_VERSION,
    AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_SUB_PARAMS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    VOCABULARY_PARAMETER_PATTERNS,
)
from dslaunch.runtime.tensor_parallel.deepspeed_layers import TensorParallelLayer
from dslaunch.runtime.tensor_parallel.layers import VocabParallelEmbedding, _ShardedLinear
from dslaunch.runtime.tensor_parallel.split import AutoTPMeta, get_shard_size_list

__all__ = ["Cut", "deepspeed_cuts", "slice_layout", "checkpoint_info"]

_NORM_KEYS = ("LayerNorm", "layer_norm", "ln_1", "ln_2")
_ROW_NAMES = ("out_proj", "o_proj", "down_proj")
_FUSED = ("qkv_proj", "query_key_value", "attn.Wqkv", "self_attn.W_pack", "c_attn", "gate_up_proj", "dense_h_to_4h")
# DeepSpeed's AutoTP has rules of its own for these models (by class name): not reproduced here
_SPECIAL_MODELS = ("GPTNeoX", "Falcon", "falcon", "Mixtral", "Phi", "ChatGLM", "GLM", "Yuan", "Arctic", "Qwen2Moe",
                   "qwen2_moe")
_AFFINE_VERSION = 1


@dataclass(frozen=True)
class Cut:
    """One parameter's cut: along ``dim``, rank r holding ``sizes[r]`` of the ``whole`` extent."""

    dim: int
    sizes: tuple[int, ...]
    row: bool = False
    """A row-parallel layer's weight (DeepSpeed lists these patterns)."""

    def segment(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of rank ``rank``'s slice along ``dim`` (ranks in order, as DeepSpeed's split)."""
        start = sum(self.sizes[:rank])
        return start, start + self.sizes[rank]


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, _ShardedLinear))


def _is_embedding(module: nn.Module) -> bool:
    return isinstance(module, (nn.Embedding, VocabParallelEmbedding))


def _block_types(model: nn.Module) -> list[type]:
    """DeepSpeed's ``get_module_list``: the classes of the modules found in ``nn.ModuleList``\\ s."""
    out: list[type] = []
    for child in model.children():
        if isinstance(child, nn.ModuleList):
            for m in child.children():
                if type(m).__name__ not in {t.__name__ for t in out}:
                    out.append(type(m))
        else:
            out += [t for t in _block_types(child) if t.__name__ not in {o.__name__ for o in out}]
    return out


def _layers(parent: str, module: nn.Module) -> list[str]:
    """DeepSpeed's ``get_layers``: a block's Linears as ``<parent>.<key>``, LayerNorms as ``ln``."""
    out: list[str] = []
    for key, sub in module._modules.items():
        if _is_linear(sub):
            out.append(f"{parent}.{key}")
        elif isinstance(sub, nn.LayerNorm) or key in ("LayerNorm", "layer_norm"):
            out.append("ln")
        elif sub is not None:
            out += _layers(key, sub)
    return out


def _row_names(block: nn.Module) -> set[str]:
    """DeepSpeed's ``tp_parser`` for one block: the names of its all-reduce (row) Linears."""
    layers: list[str] = []
    for key, sub in block._modules.items():
        if _is_linear(sub):
            layers.append(f".{key}")
        elif isinstance(sub, nn.LayerNorm) or key in _NORM_KEYS:
            layers.append("ln")
        elif sub is not None:
            layers += _layers(key, sub)
    rows = set()
    for i, layer in enumerate(layers):
        if layer == "ln":
            if layers[i - 1] != "ln":  # i == 0 looks at the last layer, as DeepSpeed's loop does
                rows.add(layers[i - 1])
        elif any(n in layer for n in _ROW_NAMES):
            rows.add(layer)
    return rows


def _refuse_paths(model: nn.Module, tensor_parallel: Mapping[str, Any]) -> None:
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None) or getattr(type(model), "_tp_plan", None) \
        or vars(model).get("_tp_plan")
    reason = ("tensor_parallel.partition_config (DeepSpeed cuts by its rules)" if tensor_parallel.get("partition_config")
              else "a vocabulary-parallel head (tensor_parallel.vocab_parallel_lm_head / loss_parallel)"
              if tensor_parallel.get("vocab_parallel_lm_head") or tensor_parallel.get("loss_parallel")
              else "a model with a Hugging Face tp_plan (DeepSpeed then cuts by the plan)" if plan
              else f"{type(model).__name__} (DeepSpeed's AutoTP has rules of its own for it)"
              if any(s in str(type(model)) for s in _SPECIAL_MODELS) else None)
    if reason:
        raise CheckpointError(f'checkpoint.format "deepspeed" cannot save AutoTP training of {reason} yet: '
                              'use format "dslaunch"')


def deepspeed_cuts(model: nn.Module, shapes: Mapping[str, tuple[int, ...]], tp: int,
                   tensor_parallel: Mapping[str, Any]) -> dict[str, Cut]:
    """Every parameter DeepSpeed's AutoTP training would cut over ``tp`` ranks, and how (the module
    docstring); a parameter not named stays whole on every rank.

    Args:
        model: the model (dslaunch's sharded layers count as the ``Linear``\\ s they replaced).
        shapes: each parameter's whole shape, by state-dict name.
        tensor_parallel: the user's ``tensor_parallel`` config section.
    Raises:
        CheckpointError: a layer DeepSpeed would cut in a way not reproduced here (names it), or
            no block with a row-parallel layer (DeepSpeed's AutoTP refuses such a model).
    """
    _refuse_paths(model, tensor_parallel)
    built = next((n for n, m in model.named_modules() if isinstance(m, TensorParallelLayer)), None)
    if built is not None:  # DeepSpeed keeps a script's own layers as built, whatever their names
        raise CheckpointError(f'checkpoint.format "deepspeed" cannot save the hand-built tensor-parallel layer '
                              f'{built!r} yet: use format "dslaunch"')
    grain = int((tensor_parallel.get("tp") or {}).get("tp_grain_size", 1))
    meta = AutoTPMeta.from_model_config(getattr(model, "config", None), grain)
    types = _block_types(model)
    rows = {t: set().union(*(_row_names(m) for m in model.modules() if type(m) is t)) for t in types}
    if not any(rows.values()):
        raise CheckpointError('checkpoint.format "deepspeed" cannot save this AutoTP model: DeepSpeed finds no '
                              "row-parallel layer (o_proj, down_proj, out_proj) in its blocks; use format \"dslaunch\"")
    cuts: dict[str, Cut] = {}
    for prefix, block in model.named_modules():
        if type(block) not in rows or not rows[type(block)]:
            continue
        _cut_block(block, prefix, "", rows[type(block)], shapes, tp, meta, cuts)
    return cuts


def _cut_block(module: nn.Module, prefix: str, parent: str, rows: set[str], shapes: Mapping[str, tuple[int, ...]],
               tp: int, meta: AutoTPMeta, cuts: dict[str, Cut]) -> None:
    """DeepSpeed's ``_replace_module`` walk of one block."""
    for key, child in module.named_children():
        full = f"{prefix}.{key}" if prefix else key
        name = f"{parent}.{key}"  # DeepSpeed's short name of the layer
        if _is_embedding(child):
            raise CheckpointError(f'checkpoint.format "deepspeed" cannot save the embedding {full!r} inside a '
                                  'transformer block (DeepSpeed cuts it along its width) yet: use format "dslaunch"')
        if not _is_linear(child):
            _cut_block(child, full, key, rows, shapes, tp, meta, cuts)
            continue
        if name == "mlp.gate" or "q_a_proj" in name or "kv_a_proj_with_mqa" in name or name == "block_sparse_moe.gate":
            continue  # DeepSpeed leaves these whole
        if any(f in name for f in _FUSED):
            raise CheckpointError(f'checkpoint.format "deepspeed" cannot save the fused layer {full!r} (DeepSpeed '
                                  'cuts each of its parts) yet: use format "dslaunch"')
        weight = shapes[f"{full}.weight"]
        row = (name in rows or "down_proj" in name) and key not in ("lm_head", "embed_out")
        dim = 1 if row else 0
        sizes = tuple(get_shard_size_list(weight[dim], tp, meta, name))
        if 0 in sizes:
            raise CheckpointError(f'checkpoint.format "deepspeed" cannot save {full!r}: DeepSpeed gives some '
                                  f"tensor rank none of it ({list(sizes)})")
        cuts[f"{full}.weight"] = Cut(dim, sizes, row)
        if f"{full}.bias" in shapes and not row:  # a row layer's bias is whole on every rank
            cuts[f"{full}.bias"] = Cut(0, sizes)


def slice_layout(cuts: Mapping[str, Cut], shapes: Mapping[str, tuple[int, ...]], rank: int) -> dict[str, list]:
    """Tensor rank ``rank``'s slices in dslaunch's layout record (``name -> [dim, segments, whole]``,
    what ``reshard.by_slices`` and ``cut_slice`` take)."""
    return {n: [c.dim, [c.segment(rank)], shapes[n][c.dim]] for n, c in cuts.items()}


def _strides(shape: list[int]) -> list[int]:
    return [math.prod(shape[i + 1:]) for i in range(len(shape))]


def _entry(shape: tuple[int, ...], cut: Cut | None, tp: int) -> dict:
    """One parameter's affine map: per rank, its one piece of the logical tensor."""
    logical = list(shape)
    ranks = {}
    for r in range(tp):
        if cut is None:
            ranks[r] = {"shard_shape": logical, "pieces": [{"shape": logical, "source": [0, _strides(logical)],
                                                            "dest": [0, _strides(logical)],
                                                            "locations": list(range(tp))}]}
            continue
        a, b = cut.segment(r)
        local = list(logical)
        local[cut.dim] = b - a
        ranks[r] = {"shard_shape": local, "pieces": [{"shape": local,
                                                      "source": [a * _strides(logical)[cut.dim], _strides(logical)],
                                                      "dest": [0, _strides(local)], "locations": [r]}]}
    return {"logical_shape": logical, "ranks": ranks}


def checkpoint_info(params: Mapping[str, tuple[int, ...]], cuts: Mapping[str, Cut], tp: int) -> dict:
    """``universal_checkpoint_info`` as DeepSpeed 0.19.8's ``collect_autotp_universal_checkpoint_info``
    records these cuts (``params``: every trained parameter's whole shape, in module order)."""
    def pattern(n: str) -> str:
        return f"^{re.escape(n)}$"

    # DeepSpeed lists the cut layers' parameters first (module order), then the untouched ones
    touched = {n for n in params if f"{n.rpartition('.')[0]}.weight" in cuts}
    cut_first = [n for n in params if n in touched] + [n for n in params if n not in touched]
    return {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: sorted(pattern(n) for n, c in cuts.items() if c.row),
            TP_REPLICATED_PARAMETER_PATTERNS: sorted(pattern(n) for n in params if n not in cuts),
            VOCABULARY_PARAMETER_PATTERNS: [], PARAMETER_WITH_SUB_PARAMS: [],
            AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: {},
            AFFINE_MAP: {AFFINE_MAP_VERSION: _AFFINE_VERSION,
                         AFFINE_MAP_PARAMS: {pattern(n): _entry(params[n], cuts.get(n), tp) for n in cut_first}}}
