"""Where dslaunch reproduces DeepSpeed 0.19.8's AutoTP cut (``deepspeed_tp_cuts``), without DeepSpeed.

The Llama-shaped decoder of ``deepspeed_tp_job``: DeepSpeed's own tag of it (``test_deepspeed_tp``)
cuts q/k/v/gate/up on dim 0, o/down on dim 1 (their biases whole) and leaves the embedding, norms
and ``lm_head`` whole; the layouts DeepSpeed cuts otherwise are refused in one line naming the layer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.deepspeed_tp import joiner
from dslaunch.runtime.checkpoint.deepspeed_tp_cuts import checkpoint_info, deepspeed_cuts, slice_layout
from tests.runtime.checkpoint import deepspeed_tp_job as job

pytestmark = pytest.mark.timeout(60)


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_the_llama_shaped_decoder_is_cut_as_deepspeeds_autotp_cuts_it() -> None:
    model = job.TinyLlamaModel()
    shapes = _shapes(model)
    cuts = deepspeed_cuts(model, shapes, 2, {})
    got = {n: (c.dim, c.sizes, c.row) for n, c in cuts.items() if n.startswith("layers.0.")}
    attn, mlp = "layers.0.self_attn.", "layers.0.mlp."
    assert got == {**{f"{attn}{p}_proj.{w}": (0, (8, 8), False) for p in "qkv" for w in ("weight", "bias")},
                   f"{attn}o_proj.weight": (1, (8, 8), True),
                   **{f"{mlp}{p}_proj.{w}": (0, (12, 12), False) for p in ("gate", "up") for w in ("weight", "bias")},
                   f"{mlp}down_proj.weight": (1, (12, 12), True)}
    assert not {"embed_tokens.weight", "lm_head.weight", "norm.weight", f"{attn}o_proj.bias"} & set(cuts)
    # the slice map joins the cut slices back into the whole
    whole = {n: torch.randn(s) for n, s in shapes.items()}
    info = checkpoint_info(shapes, cuts, 2)
    join = joiner(info["affine_map"]["params"], None)
    for name, cut in cuts.items():
        layouts = [slice_layout(cuts, shapes, r)[name] for r in (0, 1)]
        slices = [whole[name].narrow(cut.dim, a, b - a) for (a, b) in (entry[1][0] for entry in layouts)]
        assert torch.equal(join(name, slices), whole[name])
    assert info["parameter_with_row_parallelism_patterns"] == sorted(
        rf"^layers\.{i}\.{p}\.weight$" for i in (0, 1) for p in (r"self_attn\.o_proj", r"mlp\.down_proj"))


class _Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj = nn.Linear(8, 24), nn.Linear(8, 8)


class FusedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Fused()])


@pytest.mark.parametrize(("model", "section", "says"), [
    (FusedModel, {}, "fused layer 'layers.0.qkv_proj'"),
    (job.TinyLlamaModel, {"partition_config": {"layer_specs": []}}, "partition_config"),
    (job.TinyLlamaModel, {"vocab_parallel_lm_head": True}, "vocabulary-parallel head"),
])
def test_a_layout_deepspeed_cuts_otherwise_is_refused_naming_it(model: type, section: dict, says: str) -> None:
    m = model()
    with pytest.raises(CheckpointError, match="use format \"dslaunch\"") as err:
        deepspeed_cuts(m, _shapes(m), 2, section)
    assert says in str(err.value)


def test_a_hand_built_deepspeed_layer_is_refused_naming_it() -> None:
    from dslaunch.runtime.tensor_parallel.deepspeed_layers import LinearAllreduce

    model = job.TinyLlamaModel()
    model.layers[0].self_attn.o_proj = LinearAllreduce(model.layers[0].self_attn.o_proj)
    with pytest.raises(CheckpointError, match="hand-built tensor-parallel layer 'layers.0.self_attn.o_proj'"):
        deepspeed_cuts(model, _shapes(model), 2, {})
