"""AutoTP training: the model sharded over the tensor-parallel group at ``initialize``.

As DeepSpeed (0.16.4+), ``initialize`` shards the model when ``tensor_parallel.autotp_size`` > 1:
every rank builds the whole model (same seed, same weights), the planner (``auto_tp.py``) picks
the column/row/vocab layers from the model's dataflow (or ``tensor_parallel.partition_config``'s
rules), and each rank keeps its slices as trainable
parameters marked ``tensor_model_parallel`` (whole parameters such as norms stay on every slice and
count once in the gradient norm). The layers' autograd collectives (``collectives.py``) make the
gradients of every slice those of the whole model: ZeRO then only reduces over the data group.

Parameters the caller already holds (``model_parameters``, a client optimizer's param groups)
are pointed at the shards that replaced them.

Every ZeRO stage composes: ZeRO works on the data-parallel group (the ranks holding the same
slice), so at stage 3 each slice is partitioned over it, gathered over it for each module's
forward and backward, and its gradient reduced over it; the tensor layers' all-reduces run over
the tensor group as at the other stages (DeepSpeed 0.19.4+). Parameters whole on every slice
(norms, a row layer's bias) get the same gradient on every slice (computed from the same whole
activations; DeepSpeed does not reduce them over the slices either, but for ``grad_allreduce``
rules). A model built under ``zero.Init`` is gathered whole to be planned and cut.

Limitations: fewer KV heads than ``autotp_size`` is refused (each KV head would be held by
several ranks, each with part of its gradient); dropout in the replicated parts must draw the same
mask on every slice (the same seed on every rank does that, as DeepSpeed requires too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dslaunch.errors import ConfigError
from dslaunch.runtime.parallel.mpu import tensor_axis
from dslaunch.runtime.tensor_parallel.auto_tp import (
    TPPlan,
    config_heads,
    is_head_norm,
    linear_shape,
    plan_tensor_parallel,
)
from dslaunch.runtime.tensor_parallel.collectives import training_collectives
from dslaunch.runtime.tensor_parallel.deepspeed_layers import hand_built_layout
from dslaunch.runtime.tensor_parallel.invariant import Pieces, fix_attention_pieces
from dslaunch.runtime.tensor_parallel.loss import causal_lm_loss
from dslaunch.runtime.tensor_parallel.mode import set_autotp_mode
from dslaunch.runtime.tensor_parallel.partition import plan_from_rules, register_grad_allreduce
from dslaunch.runtime.tensor_parallel.shard import set_local_attributes, shard_modules

__all__ = ["shard_for_training", "repoint_parameters", "tensor_layout", "tp_model_init", "with_tp_model_init"]

_RECORD = "ds_tp_model_init"  # the attribute tp_model_init leaves on the model: (tp_size, dtype, tp_group)


def shard_for_training(model: nn.Module, grid: Any, config: Any) -> tuple[TPPlan, dict[int, nn.Parameter]]:
    """Replace ``model``'s layers by this rank's trainable shards (in place).

    Args:
        model: the whole model, with the same weights on every rank of the tensor group.
        grid: the mpu whose tensor axis is the group (``runtime.parallel.mpu.tensor_axis``).
        config: the ``DeepSpeedConfig``; read: ``tensor_parallel.autotp_size`` (the grid's tensor
            group must have that many ranks), ``tensor_parallel.partition_config`` (the plan from
            its rules instead of the dataflow: ``partition.py``), ``tensor_parallel.loss_parallel`` (the output layer
            keeps its slice of the logits and the model's ``loss_function`` becomes the
            vocab-parallel cross-entropy) and the ``layout_invariant`` block (the column and row
            layers compute in its ``chunks`` fixed pieces at any degree: ``invariant.py``).

    Returns:
        The plan, and for each replaced parameter (by ``id``) the shard that holds its slice.

    Raises:
        ConfigError: a grid whose tensor group is another size, fewer KV heads than ranks, a
            model the planner cannot trace, or ``loss_parallel`` for a model without a split output
            layer or a ``loss_function`` (one line each).

    collective: every rank of the tensor group (and of the group ``zero.Init`` partitioned the model
    over, if it did).
    """
    from dslaunch.runtime.zero.partition_parameters import GatheredParameters

    # A model built under zero.Init is whole while it is planned and cut (as without it, the whole
    # model on every rank at once); what stays replicated returns to its partitions after it, and
    # the engine's stage 3 partitions it again over the data-parallel group.
    with GatheredParameters(list(model.parameters())):
        return _shard(model, grid, config)


def _shard(model: nn.Module, grid: Any, config: Any) -> tuple[TPPlan, dict[int, nn.Parameter]]:
    from dslaunch.errors import UsageError
    from dslaunch.runtime.inference.loading import ModuleSource

    tp_size, loss_parallel = config.tensor_parallel.size, config.tensor_parallel.vocab_parallel
    # what the block cannot keep invariant was refused at load (config/layout_invariant.py)
    chunks = config.layout_invariant.chunks if config.layout_invariant.enabled else None
    group, rank = tensor_axis(grid, "group"), tensor_axis(grid, "rank")
    size = tensor_axis(grid, "world_size")
    if size != tp_size:
        raise ConfigError(f"{tp_size} but the mpu's tensor-parallel group has {size} ranks; make them equal",
                          key="tensor_parallel.autotp_size")
    heads = config_heads(model)
    if heads is not None and heads.kv_heads < tp_size:
        raise ConfigError(f"{tp_size} is more than the model's {heads.kv_heads} key/value heads: in training each "
                          f"rank must hold whole KV heads; use a divisor of {heads.kv_heads}",
                          key="tensor_parallel.autotp_size")
    rules = config.tensor_parallel.partition_config
    try:
        plan = (plan_tensor_parallel(model, tp_size, rank) if rules is None
                else plan_from_rules(model, rules, tp_size, rank))
    except UsageError as err:
        raise ConfigError(str(err), key="tensor_parallel.autotp_size") from None
    if config.expert_parallel.enabled:
        plan = _without_routed_experts(model, plan, config.expert_parallel)
    comms = training_collectives(group)
    if chunks is not None:
        comms = replace(comms, pieces=Pieces(group, tp_size, chunks))
        fix_attention_pieces(model)
    if loss_parallel:
        comms = replace(comms, gather=_keep_slice)
        model.loss_function = causal_lm_loss(_vocab_start(model, plan, config.tensor_parallel.vocab_parallel_key),
                                             group)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    layout = {**hand_built_layout(model, tp_size), **tensor_layout(model, plan)}  # the layers the script built too
    before = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    shard_modules(model, plan, ModuleSource(model), dtype, False, comms, trainable=True)
    set_local_attributes(model, plan)
    if rules is not None:
        register_grad_allreduce(model, rules, group)
    else:
        _sum_head_norm_grads(model, plan, group)
    model.ds_tensor_layout = layout  # checkpoints record it: a tag saved at one tp loads at another
    after = dict(model.named_parameters(remove_duplicate=False))
    return plan, {id(p): after[name] for name, p in before.items() if after.get(name) is not p}


def _sum_head_norm_grads(model: nn.Module, plan: TPPlan, group: Any) -> None:
    """Per-head norms (``auto_tp.is_head_norm``) beside split heads: each slice's gradient of their
    weights comes from its heads only, so it is summed over the tensor group as it is computed."""
    from dslaunch.runtime.comm import comm

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=group)
        return grad

    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    split = {spec.name.rpartition(".")[0] for spec in plan.shards}
    for name, module in model.named_modules():
        if is_head_norm(module, hidden) and name.rpartition(".")[0] in split:
            for param in module.parameters(recurse=False):
                if param.requires_grad:
                    param.register_hook(summed)


def _without_routed_experts(model: nn.Module, plan: TPPlan, autoep: Any) -> TPPlan:
    """``plan`` less the routers and routed experts of the MoE blocks AutoEP converts next: they stay
    whole (AutoEP folded with AutoTP splits their routes, not their weights: ``moe/autoep_folded.py``);
    shared experts are sharded as any MLP."""
    from dslaunch.runtime.moe.autoep_presets import detect

    kept = tuple(f"{spec.name}.{part}" for spec in detect(model, autoep)
                 for part in (spec.preset.router, spec.preset.experts))

    def whole(name: str) -> bool:
        return any(name == prefix or name.startswith(f"{prefix}.") for prefix in kept)

    return replace(plan, shards=tuple(s for s in plan.shards if not whole(s.name)),
                   attributes=tuple(a for a in plan.attributes if not whole(a[0])))


def _keep_slice(local: torch.Tensor, widths: list[int]) -> torch.Tensor:
    return local  # loss_parallel: the vocab-parallel loss reads this rank's logits as they are


def _vocab_start(model: nn.Module, plan: TPPlan, key: str) -> int:
    """This rank's first vocabulary id in the output layer, checking ``loss_parallel`` applies
    (``key``: the config key that asked for it)."""
    heads = [spec for spec in plan.shards if spec.kind == "vocab"]
    if not heads:
        raise ConfigError("true but AutoTP found no output layer as wide as the model's vocabulary "
                          "(config.vocab_size) to split; remove it", key=key)
    if not hasattr(model, "loss_function"):
        raise ConfigError(f"true but {type(model).__name__} has no loss_function (Hugging Face's hook the "
                          "vocab-parallel loss is installed on); remove it, or call "
                          "runtime.tensor_parallel.loss.vocab_parallel_cross_entropy on the split logits "
                          "yourself", key=key)
    return heads[0].segments[0][0]


def tensor_layout(model: nn.Module, plan: TPPlan) -> dict[str, list]:
    """Every parameter this rank holds a slice of: ``name -> [dim, segments, whole size of dim,
    transposed]`` in the sharded layers' layout (a weight ``[out, in]``; ``transposed``: the model's
    own module stores it ``[in, out]``, GPT-2's Conv1D). Call before sharding."""
    out: dict[str, list] = {}
    for spec in plan.shards:
        module = model.get_submodule(spec.name)
        segments = [list(s) for s in spec.segments]
        if spec.kind == "embedding":
            out[f"{spec.name}.weight"] = [0, segments, module.num_embeddings, False]
            continue
        features, inputs = linear_shape(module)
        transposed = not isinstance(module, nn.Linear)
        out[f"{spec.name}.weight"] = [1, segments, inputs, transposed] if spec.kind == "row" else \
            [0, segments, features, transposed]
        if spec.kind != "row" and getattr(module, "bias", None) is not None:
            out[f"{spec.name}.bias"] = [0, segments, features, False]
    return out


def repoint_parameters(replaced: dict[int, nn.Parameter], optimizer: Any, model_parameters: Any) -> Any:
    """Point a client optimizer's param groups (in place) and ``model_parameters`` (returned) at
    the shards that replaced the whole parameters they name."""
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            group["params"] = _mapped(replaced, group["params"])
    if model_parameters is None or not replaced:
        return model_parameters
    given = list(model_parameters)
    if given and isinstance(given[0], dict):
        return [{**g, "params": _mapped(replaced, g["params"])} for g in given]
    return _mapped(replaced, given)


def _mapped(replaced: dict[int, nn.Parameter], params: Iterable[Any]) -> list[Any]:
    return [replaced.get(id(p), p) for p in params]


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None, **kwargs: Any) -> nn.Module:
    """DeepSpeed's ``deepspeed.tp_model_init``: record the tensor-parallel degree on ``model``;
    ``initialize`` shards it (as DeepSpeed 0.17+ does: this call itself changes no weight). Like
    DeepSpeed's, it switches AutoTP's mode to training (``mode.py``).

    Args:
        model: the whole model.
        tp_size: the tensor-parallel degree; ``initialize`` uses it as ``tensor_parallel.autotp_size``
            when the config has none, and refuses a config that sets another.
        dtype: a floating dtype; ``initialize`` refuses a config whose ``fp16``/``bf16`` block
            enables another (the training precision is those blocks').
        config: accepted for DeepSpeed's signature; ``initialize`` reads the config it is given.
        tp_group: recorded; ``initialize`` refuses it with an ``mpu`` (as DeepSpeed) and without
            one (dslaunch builds the tensor group from ``autotp_size``: pass an mpu instead).

    Returns:
        ``model`` itself.

    Raises:
        ConfigError: ``tp_size`` below 1 or a non-floating ``dtype``.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_model_init(tp_size={tp_size!r}): the degree must be an integer >= 1")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"tp_model_init(dtype={dtype!r}): a floating torch dtype (torch.bfloat16, ...)")
    setattr(model, _RECORD, (tp_size, dtype, kwargs.get("tp_group")))
    set_autotp_mode(training=True)
    return model


def _config_dtype(raw: Mapping[str, Any]) -> torch.dtype | None:
    """The training precision a raw config enables (None: fp32), as DeepSpeed infers it."""
    for block, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        section = raw.get(block)
        if isinstance(section, Mapping) and section.get("enabled", False) is True:
            return dtype
    return None


def with_tp_model_init(source: Any, model: Any, mpu: Any = None) -> Any:
    """The config ``source`` with ``tensor_parallel.autotp_size`` from a ``tp_model_init`` record on
    ``model`` (a dict copy; a file is read), or ``source`` itself when there is none.

    Raises:
        ConfigError: the config sets another ``autotp_size`` than the record, or enables another
            precision than its dtype; a recorded ``tp_group`` (with an ``mpu``: as DeepSpeed; without
            one: not implemented).
    """
    record = getattr(model, _RECORD, None)
    if record is None or source is None:
        return source
    tp_size, dtype, tp_group = record
    if tp_group is not None:
        if mpu is not None:
            raise ConfigError("tp_model_init provided tp_group; deepspeed.initialize must not receive mpu (give "
                              "one of them)")
        raise ConfigError("tp_model_init(tp_group=...) is not implemented by dslaunch: pass initialize(mpu=...) "
                          "whose model-parallel group is that group, or let tensor_parallel.autotp_size build it")
    from dslaunch.runtime.config.file import read_config_file

    raw = source if isinstance(source, Mapping) else read_config_file(Path(source))
    if not isinstance(raw, Mapping):
        return source  # load_config says what is wrong with it
    section = raw.get("tensor_parallel") or {}
    given = section.get("autotp_size", 0) if isinstance(section, Mapping) else 0
    if given not in (0, 1, tp_size):
        raise ConfigError(f"{given} but tp_model_init(tp_size={tp_size}) was called on the model; make them "
                          "equal or drop one", key="tensor_parallel.autotp_size")
    enabled = _config_dtype(raw)
    if enabled is not None and enabled != dtype:
        raise ConfigError(f"Conflicting dtype: the config enables {enabled} but tp_model_init(dtype={dtype}) was "
                          "called on the model; make them agree", key="bf16" if enabled is torch.bfloat16 else "fp16")
    return {**raw, "tensor_parallel": {**section, "autotp_size": tp_size}}
