"""Which way round a Hugging Face MoE block stores its fused gate/up expert weights, from the shapes
alone (DeepSpeed's ``deepspeed.moe.fused_expert_layout``).

Two layouts occur: ``gate_up_first`` (Mixtral/Qwen-style ``gate_up_proj [E, 2F, H]`` with
``down_proj [E, H, F]``, as ``F.linear`` takes them) and ``hidden_first`` (GPT-OSS-style
``[E, H, 2F]`` with ``[E, F, H]``, to be transposed before ``F.linear``). Anything else (not 3D, an
odd fused width, shapes that do not pair up) is no fused layout: ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["FusedExpertLayout", "classify_fused_gate_up_layout"]

FusedLayout = Literal["gate_up_first", "hidden_first"]


@dataclass(frozen=True)
class FusedExpertLayout:
    """A fused pair's layout, hidden size ``H``, expert FFN size ``F`` and whether the weights need
    transposing to ``[E, out, in]``."""

    layout: FusedLayout
    hidden_size: int
    ffn_hidden_size: int
    needs_transpose: bool


def classify_fused_gate_up_layout(w1_shape: tuple[int, ...], w2_shape: tuple[int, ...]) -> FusedExpertLayout | None:
    """The layout of fused gate/up weights of shape ``w1_shape`` and down weights ``w2_shape``
    (``gate_up_first`` is tried first when both would fit), or None."""
    if len(w1_shape) != 3 or len(w2_shape) != 3:
        return None
    _, rows, cols = w1_shape
    down = tuple(w2_shape[1:])
    if rows % 2 == 0 and down == (cols, rows // 2):
        return FusedExpertLayout("gate_up_first", hidden_size=cols, ffn_hidden_size=rows // 2, needs_transpose=False)
    if cols % 2 == 0 and down == (cols // 2, rows):
        return FusedExpertLayout("hidden_first", hidden_size=rows, ffn_hidden_size=cols // 2, needs_transpose=True)
    return None
