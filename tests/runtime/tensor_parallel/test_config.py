"""The ``tensor_parallel`` ds_config block: parsed, the world divided, refusals in one line."""

from __future__ import annotations

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config

BASE = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}


def test_partition_config_is_read_as_deepspeed_writes_it() -> None:
    rules = {"use_default_specs": False, "strict_mode": True, "layer_specs": [
        {"patterns": [r".*\.qkv\.weight$"], "partition_type": "COLUMN", "shape": [[8, 4, 4], -1]},
        {"patterns": [r".*\.norm\.weight$"], "partition_type": "skip", "grad_allreduce": True,
         "model_types": ["Qwen3"]}]}
    got = load_config({**BASE, "tensor_parallel": {"autotp_size": 2, "partition_config": rules}}, 8,
                      global_world=True).tensor_parallel.partition_config
    qkv, norm = got.layer_specs
    assert (qkv.partition_type, qkv.shape, qkv.split_dim) == ("column", ((8, 4, 4), -1), 0)
    assert got.strict_mode and norm.grad_allreduce and norm.model_types == ("qwen3",)
    assert got.spec_for("layers.0.norm.weight", "qwen3") is norm and got.spec_for("layers.0.norm.weight", "llama") is None


def test_stage_3_is_accepted_with_autotp() -> None:
    cfg = load_config({**BASE, "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 3}}, 8,
                      global_world=True)
    assert (cfg.tensor_parallel.size, cfg.zero_optimization.stage) == (2, 3)


def test_model_types_match_the_class_family_without_a_model_type() -> None:
    """DeepSpeed's fallback: a model without ``config.model_type`` is named by its class
    (``...DecoderLayer``, ``...Block``, ``...Layer``); ``config.model_type`` wins when set."""
    from types import SimpleNamespace

    from torch import nn

    from dslaunch.runtime.tensor_parallel.partition import _model_type

    class Qwen3Block(nn.Module):
        pass

    class Plain(nn.Module):
        pass

    assert _model_type(Qwen3Block()) == "qwen3"
    assert _model_type(Plain()) is None
    named = Qwen3Block()
    named.config = SimpleNamespace(model_type="Llama")
    assert _model_type(named) == "llama"


def test_the_batch_counts_every_rank_as_deepspeed_does_without_an_mpu() -> None:
    """DeepSpeed (no mpu) resolves train_batch_size against the whole world, tensor slices included
    (what accelerate writes: micro * gas * processes); data_parallel_size is the true one."""
    cfg = load_config({**BASE, "train_batch_size": 16, "data_parallel_size": 4,
                       "tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 2}, "dtype": "bf16",
                                           "tp_overlap_comm": False}}, 8, global_world=True)
    assert (cfg.tensor_parallel.size, cfg.world_size, cfg.gradient_accumulation_steps) == (2, 8, 1)
    # with an mpu the world given is already the data-parallel one
    assert load_config({**BASE, "tensor_parallel": {"autotp_size": 2}}, 4).gradient_accumulation_steps == 2
    assert load_config(BASE, 4, global_world=True).tensor_parallel.size == 1  # off: 0 (the default) or 1


@pytest.mark.parametrize("extra, message", [
    ({"tensor_parallel": {"autotp_size": 3}}, "tensor_parallel.autotp_size=3 must divide the world size 8"),
    ({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}},
     "'tensor_parallel.tp.tp_size': 4 does not match tensor_parallel.autotp_size (2)"),
    ({"tensor_parallel": {"autotp_size": 2, "preset_model": "llama"}},
     "'tensor_parallel.preset_model': is not implemented by dslaunch (model presets"),
    ({"tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_spec": []}}},
     "'tensor_parallel.partition_config.layer_spec': unknown parameter for tensor_parallel.partition_config "
     "(did you mean 'layer_specs'?)"),
    ({"tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": ["q_proj("]}]}}},
     "'tensor_parallel.partition_config.layer_specs[0].patterns[0]': 'q_proj(' is not a regular expression"),
    ({"tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [
        {"patterns": ["o_proj"], "partition_type": "row", "gather_output": True}]}}},
     "'tensor_parallel.partition_config.layer_specs[0].gather_output': applies to column specs only"),
    ({"tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [
        {"patterns": ["qkv"], "partition_type": "colum"}]}}},
     "'tensor_parallel.partition_config.layer_specs[0].partition_type': must be one of column, row, skip, got "
     "'colum' (did you mean 'column'?)"),
    ({"tensor_parallel": {"autotp_sise": 2}}, "'tensor_parallel.autotp_sise': unknown parameter"),
    ({"tensor_parallel": {"autotp_size": 2}, "data_parallel_size": 8},
     "'data_parallel_size': 8 but the job has 4 data-parallel ranks"),
])
def test_refusals_are_one_line(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({**BASE, **extra}, 8, global_world=True)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


INVARIANT = {"layout_invariant": {"enabled": True, "chunks": 4}}


@pytest.mark.parametrize("extra, message", [
    ({"layout_invariant": {"enabled": True, "chunks": 6}},
     "'layout_invariant.chunks': 6 is not a multiple of tensor_parallel.autotp_size 4"),
    ({"bf16": {"enabled": True}, **INVARIANT},
     "'layout_invariant.enabled': true with bf16: layout-invariant tensor-parallel training is fp32 only"),
    ({"fp16": {"enabled": True}, **INVARIANT},
     "'layout_invariant.enabled': true with fp16: layout-invariant tensor-parallel training is fp32 only"),
    ({"tensor_parallel": {"autotp_size": 4, "loss_parallel": True}, **INVARIANT},
     "'layout_invariant.enabled': true with tensor_parallel.loss_parallel, whose softmax sums"),
    ({"tensor_parallel": {"autotp_size": 4, "vocab_parallel_lm_head": True}, **INVARIANT},
     "'layout_invariant.enabled': true with tensor_parallel.vocab_parallel_lm_head, whose softmax sums"),
])
def test_what_layout_invariant_training_refuses(extra: dict, message: str) -> None:
    raw = {**BASE, "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 4}, **extra}
    with pytest.raises(ConfigError) as err:
        load_config(raw, 8, global_world=True)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_layout_invariant_pieces_cut_every_segment_alike() -> None:
    from dslaunch.runtime.tensor_parallel.invariant import Pieces, tree_sum

    assert Pieces(None, 2, 8).of(((0, 8), (32, 40))).local() == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12),
                                                              (12, 14), (14, 16)]
    with pytest.raises(ConfigError, match="'layout_invariant.chunks': 8 does not cut a layer evenly: a rank's slice "
                                          "of 6 features does not divide into 4 pieces"):
        Pieces(None, 2, 8).of(((0, 6),))
    import torch

    parts = [torch.tensor(v) for v in (1e8, 1.0, -1e8, 1.0)]  # ((1e8 + 1) + (-1e8 + 1)): 0, where left to right gives 1
    assert tree_sum(parts).item() == 0.0 and tree_sum(parts[:3]).item() == 0.0


def test_deepspeeds_vocab_parallel_keys() -> None:
    tp = load_config({**BASE, "tensor_parallel": {"autotp_size": 4, "vocab_parallel_lm_head": True,
                                                  "vocab_parallel_ce_backend": "torch"}}, 8, global_world=True)
    assert tp.tensor_parallel.vocab_parallel and not tp.tensor_parallel.loss_parallel
    off = load_config({**BASE, "tensor_parallel": {"autotp_size": 4, "vocab_parallel_lm_head": None}}, 8,
                      global_world=True)
    assert not off.tensor_parallel.vocab_parallel
    with pytest.raises(ConfigError, match=r"^'tensor_parallel.vocab_parallel_ce_backend': .*Liger"):
        load_config({**BASE, "tensor_parallel": {"autotp_size": 4, "vocab_parallel_ce_backend": "liger"}}, 8,
                    global_world=True)
