"""Random-LTD: the kept tokens and the schedule are DeepSpeed 0.19.8's (its draw and scheduler run
on CPU in ``ds_reference.py``; its gather/scatter op is CUDA-only, so the layer is checked against
plain torch indexing instead: same outputs, same gradients); the engine moves the schedule, keeps
it in checkpoints, and ``convert_to_random_ltd``/``save_without_random_ltd`` work on a real model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dslaunch.errors import ConfigError
from dslaunch.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from dslaunch.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd, save_without_random_ltd
from dslaunch.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler
from dslaunch.runtime.data_pipeline.data_routing.tokens import bert_sample_tokens, gpt_sample_tokens
from tests.runtime.data_pipeline import reference_data as ref


@pytest.mark.timeout(200)
def test_token_draw_and_schedule_are_deepspeeds(deepspeed_out: Path) -> None:
    expected = json.loads((deepspeed_out / "random_ltd.json").read_text())
    torch.manual_seed(ref.LTD_SEED)
    gpt, no_mask = gpt_sample_tokens(5, 12, 3, 2, "cpu", None)
    bert, masks = bert_sample_tokens(4, 6, 2, 2, "cpu", ref.ltd_mask())
    assert gpt.tolist() == expected["gpt"] and no_mask is None and gpt.dtype == torch.int32
    from dslaunch.ops.random_ltd import dropping_utils  # DeepSpeed's path of the same functions

    assert dropping_utils.gpt_sample_tokens is gpt_sample_tokens
    assert bert.tolist() == expected["bert"] and [m.tolist() for m in masks] == expected["bert_masks"]
    scheduler = RandomLTDScheduler(ref.ltd_block())
    schedule = []
    for step in range(14):
        scheduler.update_seq(step)
        schedule.append([scheduler.get_current_seq(), scheduler.state["consumed_layer_tokens"]])
    assert schedule == expected["schedule"] and scheduler.state_dict() == expected["state"]


class _Block(torch.nn.Module):
    """A layer whose output of a token depends on the other kept tokens (a running mean)."""

    def __init__(self, width: int, seq_dim: int = 1):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.seq_dim = seq_dim

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple:
        counts = torch.arange(1, hidden.size(self.seq_dim) + 1).view((1, -1, 1) if self.seq_dim == 1 else (-1, 1, 1))
        return torch.tanh(self.linear(hidden.cumsum(dim=self.seq_dim) / counts)), attention_mask


@pytest.mark.timeout(30)
@pytest.mark.parametrize("batch_first", [True, False])
def test_layer_equals_plain_indexing_forward_and_backward(batch_first: bool) -> None:
    torch.manual_seed(0)
    block = _Block(8, 1 if batch_first else 0)
    scheduler = RandomLTDScheduler(ref.ltd_block())
    scheduler.set_current_seq(5)
    layer = RandomLayerTokenDrop(block)
    config = {**ref.ltd_block(), "hidden_state_order": "batch_seq_dim" if batch_first else "seq_batch_dim"}
    layer.init_config(config, scheduler, 0)
    hidden = torch.randn(3, 12, 8, requires_grad=True)
    given = hidden if batch_first else hidden.transpose(0, 1)
    torch.manual_seed(5)
    out = layer(given)[0]
    out = out if batch_first else out.transpose(0, 1)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    ours, ours_grads = out.detach(), (hidden.grad.clone(), block.linear.weight.grad.clone())
    hidden.grad, block.linear.weight.grad = None, None
    kept = scheduler.state["sample_idx"][0].long()  # [batch, 5]
    block.seq_dim = 1  # the reference runs each sample batch-first
    plain = torch.stack([hidden[b].index_copy(0, kept[b], block(hidden[b, kept[b]].unsqueeze(0))[0][0])
                         for b in range(3)])
    block.seq_dim = 1 if batch_first else 0
    (plain * torch.linspace(-1, 1, plain.numel()).view_as(plain)).sum().backward()
    assert torch.allclose(ours, plain.detach(), atol=1e-6)
    assert torch.allclose(ours_grads[0], hidden.grad, atol=1e-6)
    assert torch.allclose(ours_grads[1], block.linear.weight.grad, atol=1e-6)
    layer.eval()
    assert torch.equal(layer(given)[0], block(given)[0])  # evaluation keeps every token


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(8) for _ in range(4))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)[0]
        return self.head(x).pow(2).mean()


def _engine(**change: object) -> object:
    import dslaunch

    block = {k: v for k, v in ref.ltd_block().items() if k not in ("micro_batch_size", "global_batch_size")}
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {**block, **change}}}}
    torch.manual_seed(0)
    engine, *_ = dslaunch.initialize(model=_Net(), config=config)
    return engine


@pytest.mark.timeout(60)
def test_engine_moves_the_schedule_and_checkpoints_it(tmp_path: Path) -> None:
    engine = _engine()
    convert_to_random_ltd(engine, _Block)
    wrapped = [m for m in engine.module.modules() if isinstance(m, RandomLayerTokenDrop)]
    assert len(wrapped) == 4 and [m.random_ltd_scheduler is not None for m in wrapped] == [False, True, True, False]
    assert engine.random_ltd_enabled() and engine.random_ltd_config()["global_batch_size"] == 4
    seen = []
    for _ in range(8):  # 4 optimizer steps of 2 micro steps
        loss = engine(torch.randn(2, 12, 8))
        engine.backward(loss)
        engine.step()
        seen.append(engine.random_ltd_scheduler.get_current_seq())
    assert seen == [4, 4, 4, 4, 4, 4, 6, 6]  # update_seq(global_steps) before each forward
    engine.save_checkpoint(str(tmp_path))
    state = engine.random_ltd_scheduler.state_dict()
    again = _engine()
    convert_to_random_ltd(again, _Block)
    again.load_checkpoint(str(tmp_path))
    assert again.random_ltd_scheduler.state_dict() == state
    plain = save_without_random_ltd(again)
    assert list(plain) == list(_Net().state_dict()) and not any("random_ltd" in k for k in plain)


@pytest.mark.timeout(30)
def test_bad_settings_are_one_line() -> None:
    from dslaunch.runtime.config import load_config

    base = {"train_batch_size": 4, "data_efficiency": {"data_routing": {"random_ltd": {}}}}
    block = {k: v for k, v in ref.ltd_block().items() if k not in ("micro_batch_size", "global_batch_size")}
    for change, message in (({"random_ltd_layer_id": [1]}, "random_ltd_layer_id': names 1 layers"),
                            ({"model_type": "seq2seq"}, "model_type': must be one of decoder, encoder"),
                            ({"random_ltd_schedule": {"min_value": 4}}, "random_ltd_schedule.max_value"),
                            ({"layer_token_lr_schedule": {"enabled": True}}, "layer_token_lr_schedule.enabled")):
        base["data_efficiency"]["data_routing"]["random_ltd"] = {**block, **change}
        with pytest.raises(ConfigError, match=message):
            load_config(base, 1)
    engine = _engine(random_ltd_layer_id=[1, 7])
    with pytest.raises(ConfigError, match="random_ltd_layer_num': 2 but 1 wrapped layer"):
        convert_to_random_ltd(engine, _Block)
