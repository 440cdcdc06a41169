"""``deepspeed.moe.fused_expert_layout``: fused gate/up expert weights' layout from their shapes
(``dslaunch.runtime.moe.fused_layout``)."""

from dslaunch.runtime.moe.fused_layout import FusedExpertLayout, classify_fused_gate_up_layout

__all__ = ["FusedExpertLayout", "classify_fused_gate_up_layout"]
