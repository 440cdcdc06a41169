"""Putting DeepSpeed's fused transformer layer into a model and taking it out again, for training:
``replace_transformer_layer``, ``revert_transformer_layer`` and the generic walk ``replace_module``
(DeepSpeed's ``deepspeed.module_inject.replace_module`` functions).

``replace_transformer_layer`` swaps every instance of a BERT-family layer class (Hugging Face's
``BertLayer``/``RobertaLayer``, or the Pre-LN BERT of DeepSpeed's bing_bert example) for a
``DeepSpeedTransformerLayer`` holding copies of its weights (``HFBertLayerPolicy`` says where they
are), so the model computes the same function and trains as before. The layer's settings come
from a ``DeepSpeedTransformerConfig`` (``config``) or from the model's own config (DeepSpeed's
``model_config``, or the older API's ``bert_config``): dropout ratios, layer count, init range,
LayerNorm eps; sizes, heads and the Pre/Post-LN order are read from the layer itself.

DeepSpeed 0.19.8's ``replace_transformer_layer`` with an inference config (``config`` a
``DeepSpeedInferenceConfig``) is its inference kernel injection: refused with one line, use
``deepspeed.init_inference``. Differences from DeepSpeed: a layer the fused layer cannot stand in
for (a decoder or cross-attention layer, an activation that is not GeLU, sizes that disagree
with ``config``) is refused instead of silently changing the model; ``revert_transformer_layer``
works (DeepSpeed 0.19.8's passes arguments its own ``replace_fn`` does not take).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dslaunch.errors import ConfigError, NotInDslaunchError, UsageError
from dslaunch.kernels.transformer import DeepSpeedTransformerLayer
from dslaunch.kernels.transformer_config import DeepSpeedTransformerConfig
from dslaunch.runtime.transformer_policy import HFBertLayerPolicy

__all__ = ["replace_transformer_layer", "revert_transformer_layer", "replace_module"]

_INFERENCE_INJECTION = ("deepspeed.module_inject.replace_transformer_layer: DeepSpeed's inference kernel injection "
                        "(an inference config) is not in dslaunch; use deepspeed.init_inference(model, "
                        "replace_with_kernel_inject=True), or pass a DeepSpeedTransformerConfig (or the model's "
                        "config as model_config) to put DeepSpeed's training layer in")


def replace_module(model: nn.Module, orig_class: type | None, replace_fn: Callable[..., nn.Module],
                   _replace_policy: Any, checkpoint: str | None = None) -> nn.Module:
    """Replace, depth first, every submodule of class ``orig_class`` by ``replace_fn(child, policy,
    layer_id)`` (plus ``prefix=``/``state_dict=`` when ``replace_fn`` takes them, as DeepSpeed
    passes); ``layer_id`` counts the replacements from 0.

    Args:
        orig_class: the class to look for; None: the classes of DeepSpeed's policies here
            (Hugging Face's ``BertLayer``/``RobertaLayer``).
        checkpoint: must be None: load the weights into ``model`` before replacing.

    Returns:
        ``model``, changed in place.

    Raises:
        UsageError: ``checkpoint`` given, or no class to look for.
    """
    if checkpoint is not None:
        raise UsageError(f"replace_module: checkpoint={checkpoint!r} is not supported; load the state dict into the "
                         "model first (model.load_state_dict), then replace")
    policies: dict[type, Any] = {}
    if orig_class is not None:
        policies[orig_class] = _replace_policy
    else:
        HFBertLayerPolicy(None)
        policies.update({cls: HFBertLayerPolicy for cls in HFBertLayerPolicy._orig_layer_class or ()})
    if not policies:
        raise UsageError("replace_module: no class to replace: pass orig_class (transformers is not installed, so "
                         "there is no default BERT policy)")
    params = inspect.signature(replace_fn).parameters
    extra = {name for name in ("prefix", "state_dict") if name in params} | (
        {"prefix", "state_dict"} if any(p.kind is p.VAR_KEYWORD for p in params.values()) else set())
    _walk(model, policies, replace_fn, extra, "", [0])
    return model


def _walk(module: nn.Module, policies: dict[type, Any], replace_fn: Callable[..., nn.Module], extra: set[str],
          prefix: str, layer_id: list[int]) -> None:
    for name, child in module.named_children():
        if type(child) in policies:
            kwargs = {k: v for k, v in (("prefix", prefix + name), ("state_dict", None)) if k in extra}
            setattr(module, name, replace_fn(child, policies[type(child)], layer_id[0], **kwargs))
            layer_id[0] += 1
        else:
            _walk(child, policies, replace_fn, extra, f"{prefix}{name}.", layer_id)


def _model_settings(model_config: Any) -> dict[str, Any]:
    """DeepSpeedTransformerConfig arguments from a BERT config (Hugging Face's or bing_bert's)."""
    keys = {"attn_dropout_ratio": "attention_probs_dropout_prob", "hidden_dropout_ratio": "hidden_dropout_prob",
            "num_hidden_layers": "num_hidden_layers", "initializer_range": "initializer_range",
            "layer_norm_eps": "layer_norm_eps"}
    return {ours: getattr(model_config, theirs) for ours, theirs in keys.items()
            if getattr(model_config, theirs, None) is not None}


def _check_gelu(child: nn.Module) -> None:
    act = getattr(getattr(child, "intermediate", None), "intermediate_act_fn", None)
    if act is None:
        return  # bing_bert's fused dense_act: its BERT uses GeLU
    probe = torch.linspace(-6, 6, 241)
    with torch.no_grad():
        got = act(probe.to(child.intermediate.dense.weight.dtype)).float()
    if not torch.allclose(got, F.gelu(probe, approximate="tanh"), atol=2e-3):
        raise ConfigError(f"the layer's activation ({type(act).__name__}) is not GeLU; DeepSpeedTransformerLayer "
                          "computes GeLU, so this model would change: keep its layers", key="hidden_act")


def _layer_config(child: nn.Module, policy: HFBertLayerPolicy, config: DeepSpeedTransformerConfig | None,
                  settings: dict[str, Any]) -> DeepSpeedTransformerConfig:
    if getattr(child, "is_decoder", False) or getattr(child, "add_cross_attention", False):
        raise UsageError(f"replace_transformer_layer: {type(child).__name__} is a decoder/cross-attention layer; "
                         "DeepSpeedTransformerLayer is bidirectional self-attention only")
    _check_gelu(child)
    hidden, heads, eps, _ = policy.get_hidden_heads()
    found = {"hidden_size": hidden, "heads": heads, "intermediate_size": policy.mlp()[0].shape[0],
             "pre_layer_norm": policy.pre_attn_norm}
    if config is None:
        return DeepSpeedTransformerConfig(**{"layer_norm_eps": eps, **settings, **found})
    for key, value in found.items():
        given = getattr(config, key)
        if given != value and not (given == -1 and key != "pre_layer_norm"):
            raise ConfigError(f"{given!r} does not match the model's layer ({value!r}); pass {key}={value!r}",
                              key=f"DeepSpeedTransformerConfig.{key}")
    return dataclasses.replace(config, **found)


def _copy_in(child: nn.Module, policy: HFBertLayerPolicy, cfg: DeepSpeedTransformerConfig) -> nn.Module:
    src = policy.parameter_map()
    stacked = {name: torch.cat([t.detach() for t in tensors]) for name, tensors in src.items()}
    weights = [*torch.chunk(stacked["attn_qkvw"], 3), stacked["attn_ow"], stacked["attn_nw"], stacked["inter_w"],
               stacked["output_w"], stacked["norm_w"]]
    biases = [None, None, None, stacked["attn_ob"], stacked["attn_nb"], stacked["inter_b"], stacked["output_b"],
              stacked["norm_b"]]
    layer = DeepSpeedTransformerLayer(cfg, [w.clone() for w in weights], [b if b is None else b.clone() for b in biases])
    with torch.no_grad():
        layer.attn_qkvb.copy_(stacked["attn_qkvb"])
    return layer.train(child.training)


def replace_transformer_layer(orig_layer_impl: type | None, model: nn.Module, checkpoint_dict: Any = None,
                              config: Any = None, model_config: Any = None, training_mode: bool = False,
                              replacement_sources: Any = None, *, micro_batch_size: int = -1, bert_config: Any = None,
                              seed: int = -1, preln: bool | None = None, fp16: bool | None = None,
                              training: bool = True, huggingface: bool = False, local_rank: int = -1) -> nn.Module:
    """Replace every ``orig_layer_impl`` layer of ``model`` by a ``DeepSpeedTransformerLayer`` with its weights.

    Takes DeepSpeed 0.19.8's arguments (``config`` a ``DeepSpeedTransformerConfig``, ``model_config``
    the model's config) and the older training API's keywords (``bert_config``, ``micro_batch_size``,
    ``seed``, ``preln``, ``fp16``, ``training``, ``local_rank``; ``huggingface`` is not needed).

    Args:
        orig_layer_impl: the layer class (None: Hugging Face's ``BertLayer``/``RobertaLayer``).
        config: the new layers' settings; their sizes and Pre/Post-LN order come from the layers
            (a given size must match). None: built from ``model_config``/``bert_config``.
        checkpoint_dict, replacement_sources: must be None (DeepSpeed's inference loading).

    Returns:
        ``model``, changed in place.

    Raises:
        NotInDslaunchError: ``config`` is an inference config (DeepSpeed's kernel injection).
        ConfigError: no settings given, a size or ``preln`` that disagrees with the layer, or an
            activation that is not GeLU.
        UsageError: a decoder/cross-attention layer, or checkpoint arguments.
    """
    if config is not None and not isinstance(config, DeepSpeedTransformerConfig):
        raise NotInDslaunchError(_INFERENCE_INJECTION)
    if checkpoint_dict is not None or replacement_sources is not None:
        raise UsageError("replace_transformer_layer: checkpoint_dict/replacement_sources are DeepSpeed's inference "
                         "loading; load the weights into the model first")
    source = model_config if model_config is not None else bert_config
    if config is None and source is None:
        raise ConfigError("give config=DeepSpeedTransformerConfig(...) or the model's config (model_config=...)",
                          key="replace_transformer_layer")
    settings = {**_model_settings(source), "batch_size": micro_batch_size, "seed": seed, "local_rank": local_rank,
                "training": training, **({} if fp16 is None else {"fp16": fp16})}

    def replace_fn(child: nn.Module, policy_cls: Any, layer_id: int) -> nn.Module:
        policy = (policy_cls if isinstance(policy_cls, type) else HFBertLayerPolicy)(child)
        if preln is not None and preln != policy.pre_attn_norm:
            raise ConfigError(f"preln={preln} but {type(child).__name__} is "
                              f"{'Pre' if policy.pre_attn_norm else 'Post'}-LN", key="preln")
        return _copy_in(child, policy, _layer_config(child, policy, config, settings))

    return replace_module(model, orig_layer_impl, replace_fn, HFBertLayerPolicy)


def revert_transformer_layer(orig_layer_impl: type, model: nn.Module, config: Any, preln: bool = False) -> nn.Module:
    """Replace every ``DeepSpeedTransformerLayer`` of ``model`` by ``orig_layer_impl(config)`` holding its weights.

    Args:
        orig_layer_impl: the BERT layer class to build (Hugging Face's ``BertLayer``, or a Pre-LN one
            with ``PreAttentionLayerNorm`` when ``preln``).
        config: the argument of ``orig_layer_impl`` (the model's config).
        preln: whether the layers are Pre-LN.

    Returns:
        ``model``, changed in place.

    Raises:
        ConfigError: ``preln`` disagrees with a layer, or the built layer's shapes differ.
    """
    def replace_fn(child: DeepSpeedTransformerLayer, policy_cls: Any, layer_id: int) -> nn.Module:
        if child.config.pre_layer_norm != preln:
            raise ConfigError(f"preln={preln} but the layer's config has pre_layer_norm={child.config.pre_layer_norm}",
                              key="preln")
        orig = orig_layer_impl(config)
        first = next(child.parameters())
        orig.to(device=first.device, dtype=first.dtype)
        with torch.no_grad():
            for name, targets in HFBertLayerPolicy(orig).parameter_map().items():
                parts = torch.chunk(getattr(child, name).detach(), len(targets))
                for target, part in zip(targets, parts, strict=True):
                    if target.shape != part.shape:
                        raise ConfigError(f"{type(orig).__name__}'s {name} part has shape {tuple(target.shape)}, "
                                          f"the DeepSpeed layer's {tuple(part.shape)}", key="config")
                    target.copy_(part)
        return orig.train(child.training)

    return replace_module(model, DeepSpeedTransformerLayer, replace_fn, None)
