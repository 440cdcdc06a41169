"""Where AutoEP finds a Hugging Face MoE model's expert blocks: the presets and the detection.

A preset names, for one model family, the blocks (a regular expression over module names), the
block's router and experts children, the experts' 3D weights, the ``model.config`` attributes of
the expert count and of experts per token, and the shared experts beside the routed ones. The
``expert_parallel`` block's layer-finding keys override the preset's (DeepSpeed's rule).

``detect(model, config)`` returns one ``LayerSpec`` per block found and checks what dslaunch relies
on: the expert count divisible by ``autoep_size``, and the routing keys of the block (``top_k``,
``route_norm``, ``score_func``, ``route_scale``/``routed_scaling_factor``, expert groups) equal to
what the model's own router does, since dslaunch routes with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.expert_parallel import ExpertParallelConfig

__all__ = ["Preset", "LayerSpec", "PRESETS", "detect"]


@dataclass(frozen=True)
class Preset:
    """How one model family lays out its MoE blocks."""

    model_types: tuple[str, ...]
    num_experts_attr: str
    score_func: str = "softmax"
    route_norm: bool | None = True
    """None: the model's ``config.norm_topk_prob`` decides."""
    shared_experts: str | None = None
    shared_experts_gate: str | None = None
    layer_pattern: str = r"model\.layers\.\d+\.mlp"
    router: str = "gate"
    experts: str = "experts"
    w1: str = "gate_up_proj"
    w2: str = "down_proj"
    w3: str | None = None
    top_k_attr: str = "num_experts_per_tok"


PRESETS: dict[str, Preset] = {
    "mixtral": Preset(("mixtral",), "num_local_experts"),
    "qwen3_moe": Preset(("qwen3_moe", "qwen2_moe"), "num_experts", route_norm=None,
                        shared_experts="shared_expert", shared_experts_gate="shared_expert_gate"),
    "deepseek_v3": Preset(("deepseek_v3",), "n_routed_experts", score_func="sigmoid", route_norm=None,
                          shared_experts="shared_experts"),
}


@dataclass(frozen=True)
class LayerSpec:
    """One MoE block found: its module name and what its conversion needs. The routing rule
    (``score_func``, ``route_norm``, ``route_scale``) is used only by a router that returns bare
    logits (a custom model's); Hugging Face 5's routers choose themselves."""

    name: str
    preset: Preset
    num_experts: int
    top_k: int
    score_func: str = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0


def _with_overrides(preset: Preset, cfg: ExpertParallelConfig) -> Preset:
    given = {"layer_pattern": cfg.moe_layer_pattern, "router": cfg.router_pattern, "experts": cfg.expert_pattern,
             "w1": cfg.expert_w1, "w2": cfg.expert_w2, "w3": cfg.expert_w3, "num_experts_attr": cfg.num_experts_attr,
             "top_k_attr": cfg.top_k_attr, "shared_experts": cfg.shared_experts_pattern,
             "shared_experts_gate": cfg.shared_experts_gate_pattern}
    preset = replace(preset, **{k: v for k, v in given.items() if v is not None})
    return replace(preset, shared_experts=None, shared_experts_gate=None) if cfg.has_shared_experts is False else preset


def _candidates(model_config: Any, cfg: ExpertParallelConfig) -> list[tuple[str, Preset]]:
    """The preset named, else the model type's, else a custom one from the patterns, else all."""
    if cfg.preset_model is not None:
        return [(cfg.preset_model, _with_overrides(PRESETS[cfg.preset_model], cfg))]
    model_type = getattr(model_config, "model_type", None)
    for name, preset in PRESETS.items():
        if model_type in preset.model_types:
            return [(name, _with_overrides(preset, cfg))]
    if cfg.moe_layer_pattern is not None:
        return [("custom", _with_overrides(Preset((), "num_local_experts"), cfg))]
    return [(name, _with_overrides(preset, cfg)) for name, preset in PRESETS.items()]


def _shape(weight: torch.Tensor) -> tuple[int, ...]:
    """The whole shape, also of a parameter zero.Init has partitioned (``ds_shape``)."""
    return tuple(getattr(weight, "ds_shape", weight.shape))


def _fused_weight(experts: torch.nn.Module, name: str) -> torch.Tensor | None:
    weight = getattr(experts, name, None)
    return weight if isinstance(weight, torch.Tensor) and len(_shape(weight)) == 3 else None


def _find(model: torch.nn.Module, preset: Preset) -> list[str]:
    pattern = re.compile(preset.layer_pattern)
    return [name for name, module in model.named_modules()
            if pattern.fullmatch(name) and getattr(module, preset.router, None) is not None
            and _fused_weight(getattr(module, preset.experts, torch.nn.Module()), preset.w1) is not None]


def detect(model: torch.nn.Module, cfg: ExpertParallelConfig) -> list[LayerSpec]:
    """The MoE blocks of ``model`` to convert, checked against ``cfg``.

    Raises:
        ConfigError: no block found (naming what was looked for), an expert count that
            ``autoep_size`` does not divide, a block whose weights are not 3D, or a routing key that
            differs from the model's router.
    """
    model_config = getattr(model, "config", None)
    tried = _candidates(model_config, cfg)
    for family, preset in tried:
        names = _find(model, preset)
        if names:
            return [_spec(model, name, preset, family, model_config, cfg) for name in names]
    looked = "; ".join(f"{family}: modules matching '{p.layer_pattern}' with a '{p.router}' child and 3D "
                       f"'{p.experts}.{p.w1}' weights" for family, p in tried)
    raise ConfigError(f"found no MoE block to convert in {type(model).__name__} ({looked}); name the model's "
                      "family in preset_model or give moe_layer_pattern/router_pattern/expert_pattern",
                      key="expert_parallel.enabled")


def _spec(model: torch.nn.Module, name: str, preset: Preset, family: str, model_config: Any,
          cfg: ExpertParallelConfig) -> LayerSpec:
    block = model.get_submodule(name)
    experts = getattr(block, preset.experts)
    w1 = _fused_weight(experts, preset.w1)
    for weight in (preset.w2, preset.w3):
        if weight is not None and _fused_weight(experts, weight) is None:
            raise ConfigError(f"{name}.{preset.experts} has no 3D weight '{weight}' (the {family} layout); set "
                              "expert_w2/expert_w3 to the model's names", key="expert_parallel.expert_w2")
    num_experts = _shape(w1)[0]
    if num_experts % cfg.autoep_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ConfigError(f"{cfg.autoep_size} does not divide the {num_experts} experts of {name}; use one of "
                          f"{divisors}", key="expert_parallel.autoep_size")
    top_k = getattr(model_config, preset.top_k_attr, None)
    router_k = getattr(getattr(block, preset.router), "top_k", None)
    top_k = int(router_k if router_k is not None else top_k if top_k is not None else 0)
    custom = family == "custom"  # the block's routing keys are the rule (DeepSpeed's custom defaults)
    top_k = cfg.top_k if custom and isinstance(cfg.top_k, int) else top_k
    if top_k < 1:
        raise ConfigError(f"cannot tell how many experts {name} routes each token to: set top_k_attr to the "
                          "model.config attribute that holds it", key="expert_parallel.top_k_attr")
    if custom:
        return LayerSpec(name, preset, num_experts, top_k, "softmax" if cfg.score_func == "auto" else cfg.score_func,
                         True if cfg.route_norm is None else cfg.route_norm, cfg.route_scale)
    _check_routing(cfg, preset, model_config, top_k, family)
    return LayerSpec(name, preset, num_experts, top_k, preset.score_func, preset.route_norm is not False)


def _check_routing(cfg: ExpertParallelConfig, preset: Preset, model_config: Any, top_k: int, family: str) -> None:
    """Each routing key given must say what the model's router does (dslaunch routes with it)."""
    norm = preset.route_norm if preset.route_norm is not None else getattr(model_config, "norm_topk_prob", False)
    scale = getattr(model_config, "routed_scaling_factor", 1.0) or 1.0
    model = {"top_k": top_k, "route_norm": bool(norm), "score_func": preset.score_func,
             "routed_scaling_factor": float(scale), "route_scale": float(scale),
             "num_expert_groups": getattr(model_config, "n_group", None),
             "num_limited_groups": getattr(model_config, "topk_group", None)}
    given = {"top_k": cfg.top_k, "route_norm": cfg.route_norm,
             "score_func": None if cfg.score_func == "auto" else cfg.score_func,
             "routed_scaling_factor": None if cfg.routed_scaling_factor == "auto" else cfg.routed_scaling_factor,
             "route_scale": None if cfg.route_scale == 1.0 else cfg.route_scale,
             "num_expert_groups": cfg.num_expert_groups, "num_limited_groups": cfg.num_limited_groups}
    for key, value in given.items():
        if value is None or value == "auto" or value == model[key]:
            continue
        raise ConfigError(f"{value!r}, but the {family} model's router uses {model[key]!r}: dslaunch routes with "
                          "the model's own router (its top-k and normalisation); remove the key",
                          key=f"expert_parallel.{key}")
