"""dslaunch's own checks of DeepSpeed Compression, where DeepSpeed has no answer to compare with:
the ``compression_training`` block's errors (one line naming the key), l1 channel pruning (which
DeepSpeed's ``torch.linalg.norm`` call cannot compute on today's torch) against plain torch,
GPT-2's ``Conv1D`` conversion, and the errors of the model surgery."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dslaunch.errors import ConfigError
from dslaunch.runtime.compression.compress import convert_conv1d_to_linear, init_compression, redundancy_clean
from dslaunch.runtime.compression.layers import LinearLayer_Compress
from dslaunch.runtime.config.ds_config import load_config
from tests.runtime.compression.scenarios import TinyBert, TinyCNN

WQ = {"shared_parameters": {"enabled": True}, "different_groups": {"g": {"params": {"start_bits": 8, "target_bits": 4},
                                                                         "modules": ["query"]}}}


@pytest.mark.parametrize("block, key, words", [
    ({"weight_quantizaton": {}}, "compression_training.weight_quantizaton", "did you mean 'weight_quantization'"),
    ({"row_pruning": {"shared_parameters": {"enabled": True, "method": "l2"}}},
     "compression_training.row_pruning.shared_parameters.method", "one of l1, topk"),
    ({"sparse_pruning": {"shared_parameters": {"enabled": True}}}, "compression_training.sparse_pruning.different_groups",
     "must be given"),
    ({"sparse_pruning": {"shared_parameters": {"enabled": True, "method": "snip_momentum"}}},
     "compression_training.sparse_pruning.shared_parameters.method", "Neural Compressor"),
    ({"head_pruning": {"shared_parameters": {"enabled": True}, "different_groups": {}}},
     "compression_training.head_pruning.shared_parameters.num_heads", "must be given"),
    ({"activation_quantization": {"shared_parameters": {"enabled": True},
                                  "different_groups": {"a": {"params": {"bits": 6}}}}},
     "compression_training.activation_quantization.different_groups.a.params.bits", "4 or 8"),
    ({"weight_quantization": {**WQ, "different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 8}}}}},
     "compression_training.weight_quantization.different_groups.g.params.target_bits", "<= start_bits"),
    ({"weight_quantization": {**WQ, "different_groups": {"g": {"params": {"target_bits": 8}}}}},
     "compression_training.weight_quantization.different_groups.g.params.start_bits", "required"),
    ({"weight_quantization": {"shared_parameters": {"enabled": True, "quantizer_kernel": True}, "different_groups": {}}},
     "compression_training.weight_quantization.shared_parameters.quantizer_kernel", "CUDA"),
    ({"channel_pruning": {"shared_parameters": {"enabled": True}, "different_groups": {
        "c": {"params": {"dense_ratio": 0.5}, "modules": ["conv("]}}}},
     "compression_training.channel_pruning.different_groups.c.modules[0]", "not a valid regular expression"),
    ({"row_pruning": {"shared_parameters": {"enabled": True}, "different_groups": {
        "r": {"params": {"dense_ratio": 0.5}, "modules": ["a", "b"], "related_modules": [["c"]]}}}},
     "compression_training.row_pruning.different_groups.r.related_modules", "one per 'modules' pattern"),
    ({"layer_reduction": {"enabled": True}}, "compression_training.layer_reduction.module_name_prefix", "must name"),
])
@pytest.mark.timeout(30)
def test_a_bad_block_is_one_line_naming_the_key(block: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 2, "compression_training": block}, world_size=1)
    msg = str(err.value)
    assert msg.startswith(f"'{key}': ") and words in msg and "\n" not in msg


@pytest.mark.timeout(30)
def test_the_block_is_parsed_into_the_config() -> None:
    cfg = load_config({"train_batch_size": 2, "compression_training": {"weight_quantization": WQ}}, world_size=1)
    wq = cfg.compression_training.technique("weight_quantization")
    assert wq.enabled and wq.schedule_offset == 0 and wq.groups[0].params["target_bits"] == 4
    assert not cfg.compression_training.technique("row_pruning").enabled
    with pytest.raises(TypeError):
        wq.shared["enabled"] = False  # frozen


@pytest.mark.timeout(30)
def test_l1_channel_pruning_keeps_the_channels_of_largest_l1_norm() -> None:
    torch.manual_seed(3)
    model = TinyCNN()
    norms = model.conv1.weight.detach().abs().sum(dim=(1, 2, 3))
    keep = norms.argsort(descending=True)[:4].sort().values
    pruned = torch.ones(8, dtype=torch.bool)
    pruned[keep] = False
    with torch.no_grad():  # a pruned channel then leaves batch-norm as 0, so masking == removing
        model.bn1.running_mean.copy_(torch.randn(8).masked_fill(pruned, 0.0))
        model.bn1.bias.copy_(torch.randn(8).masked_fill(pruned, 0.0))
    w1, w2, mean = model.conv1.weight.detach().clone(), model.conv2.weight.detach().clone(), model.bn1.running_mean.clone()
    config = {"compression_training": {"channel_pruning": {
        "shared_parameters": {"enabled": True, "method": "l1"},
        "different_groups": {"c": {"params": {"dense_ratio": 0.5}, "modules": ["conv1"],
                                   "related_modules": [["bn1", "conv2"]]}}}}}
    init_compression(model, config)
    model.conv1.channel_pruning_enabled = True
    model.eval()
    x = torch.randn(2, 3, 6, 6)
    masked = model(x)
    redundancy_clean(model, config)
    assert torch.equal(model.conv1.weight, w1[keep]) and torch.equal(model.conv2.weight, w2[:, keep])
    assert torch.equal(model.bn1.running_mean, mean[keep]) and model.bn1.num_features == 4
    assert model.conv1.out_channels == 4 and model.conv2.in_channels == 4
    torch.testing.assert_close(model(x), masked, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(30)
def test_conv1d_becomes_an_equal_linear() -> None:
    class Conv1D(nn.Module):
        def __init__(self, nf: int, nx: int) -> None:
            super().__init__()
            self.nf, self.weight, self.bias = nf, nn.Parameter(torch.randn(nx, nf)), nn.Parameter(torch.randn(nf))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)

    model = nn.Sequential(Conv1D(6, 4), Conv1D(3, 6))
    x = torch.randn(5, 4)
    expected = model(x)
    convert_conv1d_to_linear(model, Conv1D)
    assert all(type(m) is nn.Linear for m in model)
    torch.testing.assert_close(model(x), expected)


@pytest.mark.timeout(30)
def test_a_module_in_two_groups_of_one_technique_is_refused() -> None:
    groups = {"a": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["query"]},
              "b": {"params": {"start_bits": 8, "target_bits": 4}, "modules": ["attention.self"]}}
    with pytest.raises(ConfigError, match="'layer.0.attention.self.query' .* already in another group"):
        init_compression(TinyBert(), {"compression_training": {"weight_quantization": {
            "shared_parameters": {"enabled": True}, "different_groups": groups}}})


@pytest.mark.timeout(30)
def test_a_technique_on_a_layer_it_does_not_fit_names_the_module() -> None:
    with pytest.raises(ConfigError, match="row_pruning does not apply to 'conv1'"):
        init_compression(TinyCNN(), {"compression_training": {"row_pruning": {
            "shared_parameters": {"enabled": True}, "different_groups": {"r": {"params": {"dense_ratio": 0.5},
                                                                               "modules": ["conv1"]}}}}})


@pytest.mark.timeout(30)
def test_every_compressible_layer_is_replaced_and_keeps_its_weights() -> None:
    model = TinyBert()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    init_compression(model, {"compression_training": {"weight_quantization": WQ}})
    assert isinstance(model.layer[1].output.dense, LinearLayer_Compress)
    assert model.layer[0].attention.self.query.weight.target_bits == 4
    assert model.layer[0].attention.self.key.weight.target_bits is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
