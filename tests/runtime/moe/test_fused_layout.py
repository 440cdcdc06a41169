"""``deepspeed.moe.fused_expert_layout.classify_fused_gate_up_layout`` on the two Hugging Face
layouts of fused expert weights, and on shapes that are neither."""

from __future__ import annotations

import pytest
import torch

from dslaunch.moe.fused_expert_layout import classify_fused_gate_up_layout

pytestmark = pytest.mark.timeout(30)


def test_the_layout_found_makes_the_weights_usable_by_f_linear() -> None:
    """Both layouts of one expert's weights (H=6, F=4) classify to sizes that let ``F.linear`` run
    gate/up then down on a token, transposing only ``hidden_first``."""
    gate_up, down = torch.randn(3, 8, 6), torch.randn(3, 6, 4)
    for w1, w2, name in ((gate_up, down, "gate_up_first"),
                         (gate_up.transpose(1, 2), down.transpose(1, 2), "hidden_first")):
        layout = classify_fused_gate_up_layout(tuple(w1.shape), tuple(w2.shape))
        assert layout is not None and layout.layout == name
        assert (layout.hidden_size, layout.ffn_hidden_size) == (6, 4)
        if layout.needs_transpose:
            w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
        hidden = torch.nn.functional.linear(torch.randn(6), w1[0])
        assert torch.nn.functional.linear(hidden[:layout.ffn_hidden_size], w2[0]).shape == (6,)


@pytest.mark.parametrize("w1, w2", [((8, 64, 64), (8, 64, 64)), ((8, 255, 64), (8, 64, 127)),
                                    ((64, 64), (64, 64)), ((8, 256, 64), (8, 64, 64))])
def test_shapes_of_no_fused_layout_give_none(w1: tuple[int, ...], w2: tuple[int, ...]) -> None:
    assert classify_fused_gate_up_layout(w1, w2) is None
