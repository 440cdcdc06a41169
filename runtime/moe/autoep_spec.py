"""DeepSpeed's record of one detected MoE block (``auto_ep_config.MoELayerSpec``), accepted where
dslaunch's ``autoep_presets.LayerSpec`` is: a script that builds a converted block by hand
(``AutoEPMoELayer(spec, block, ep_size, ep_rank, config)``) passes DeepSpeed's fields.

``layer_spec()`` keeps what dslaunch's conversion reads (the block's name, its router and expert
children and weight names, the shared experts, the expert count and the routing rule); the fields
that only choose among DeepSpeed's kernels or router-logit captures are kept, not read. A layout
dslaunch does not convert is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslaunch.runtime.moe.autoep_presets import LayerSpec, Preset

__all__ = ["MoELayerSpec"]


@dataclass(frozen=True)
class MoELayerSpec:
    """DeepSpeed's fields of one MoE block (the defaults are DeepSpeed's)."""

    moe_module_name: str
    model_family: str
    router_name: str
    experts_name: str
    expert_storage: str
    expert_w1_name: str
    expert_w2_name: str
    expert_w3_name: str | None
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_hidden_size: int
    score_func: str
    score_apply: str
    route_norm: bool
    gate_bias: bool
    return_router_logits: bool
    router_logits_capture_target: str
    router_logits_capture_index: int | None
    router_logits_capture_layer_name: str | None
    has_shared_experts: bool
    shared_experts_name: str
    shared_experts_gate_name: str = ""
    route_scale: float = 1.0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    group_score_func: str = "top2_sum"
    supports_expert_bias: bool = True
    unsupported_router_bias_names: tuple[str, ...] = ()
    preset_adapter: str = "default"
    router_logits_capture_mode: str = "post_score"
    moe_output_shape: str = "batched"
    e_score_correction_bias_path: str | None = None
    expert_activation: str = "swiglu"
    expert_activation_alpha: float = 1.702
    expert_activation_limit: float = 7.0

    def layer_spec(self) -> LayerSpec:
        """dslaunch's record of the same block.

        Raises:
            ConfigError: experts stored as a module list, scores applied before the experts, or
                expert groups (dslaunch converts fused 3D experts routed after them, one group).
        """
        from dslaunch.errors import ConfigError

        refused = {"expert_storage": (self.expert_storage != "fused_3d", "fused_3d"),
                   "score_apply": (self.score_apply != "post", "post"),
                   "num_expert_groups": (self.num_expert_groups not in (None, 1), "None or 1")}
        for key, (broken, valid) in refused.items():
            if broken:
                raise ConfigError(f"{getattr(self, key)!r} is not converted by dslaunch's AutoEP; use {valid}",
                                  key=f"MoELayerSpec.{key}")
        shared = self.shared_experts_name if self.has_shared_experts and self.shared_experts_name else None
        preset = Preset((self.model_family,), "num_experts", self.score_func, self.route_norm, shared,
                        self.shared_experts_gate_name or None, router=self.router_name, experts=self.experts_name,
                        w1=self.expert_w1_name, w2=self.expert_w2_name, w3=self.expert_w3_name)
        return LayerSpec(self.moe_module_name, preset, self.num_experts, self.top_k, self.score_func,
                         self.route_norm, self.route_scale)
