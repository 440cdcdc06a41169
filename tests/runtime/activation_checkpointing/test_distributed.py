"""``deepspeed.checkpointing`` on gloo ranks: ``partition_activations`` over a model-parallel group
(each rank keeps half of every input), and ZeRO-3 with frozen and tied parameters: the gradients
are bit for bit those of the same engine without checkpointing."""

from __future__ import annotations

import pytest

from tests.distributed import run_world

pytestmark = pytest.mark.timeout(120)


def _partitioned(rank: int, world: int, which: str, cpu: bool) -> dict:
    import torch

    import dslaunch
    from dslaunch.runtime.activation_checkpointing import checkpointing as ckpt
    from dslaunch.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    dslaunch.init_distributed(verbose=False)
    grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1))
    ckpt.configure(grid, partition_activations=True, checkpoint_in_cpu=cpu)
    torch.manual_seed(0)  # the same weights and input on both ranks (replicated activations)
    lin = torch.nn.Linear(9, 9)
    x = torch.randn(3, 9, requires_grad=True)  # 27 elements: split 14 + 14 (one padding)

    def f(a: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(lin(a).tanh(), 0.3)

    torch.manual_seed(1)
    f(x).square().sum().backward()
    plain = [x.grad.clone(), lin.weight.grad.clone()]
    x.grad = lin.weight.grad = lin.bias.grad = None
    torch.manual_seed(1)
    y = getattr(ckpt, which)(f, x)
    kept = y.grad_fn.call.kept[0] if which == "checkpoint" else None
    y.square().sum().backward()
    return {"equal": [torch.equal(a, b) for a, b in zip(plain, [x.grad, lin.weight.grad], strict=True)],
            "kept": None if kept is None else [kept.nbytes(), kept.data.device.type],
            "piece": None if kept is None else kept.data.tolist(), "x": x.detach().flatten().tolist()}


@pytest.mark.parametrize("cpu", [False, True], ids=["device", "cpu"])
@pytest.mark.parametrize("which", ["checkpoint", "non_reentrant_checkpoint"])
def test_partition_activations_splits_inputs_over_the_model_parallel_group(which: str, cpu: bool) -> None:
    results = run_world(_partitioned, 2, which, cpu)
    assert all(r["equal"] == [True, True] for r in results)
    if which == "checkpoint":
        assert [r["kept"] for r in results] == [[14 * 4, "cpu"]] * 2  # half of 27 floats, padded
        assert results[0]["piece"] + results[1]["piece"][:13] == results[0]["x"]


def _zero3(rank: int, world: int, wrap: str | None, mode: str) -> dict:
    import contextlib
    import io

    import torch

    import dslaunch
    from dslaunch.utils import safe_get_full_grad
    from tests.runtime.activation_checkpointing.blocks import Stack, tokens

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "activation_checkpointing": {"mode": mode, "profile": wrap is not None}}
    dslaunch.init_distributed(verbose=False)
    torch.manual_seed(0)
    with dslaunch.zero.Init(config_dict_or_path=cfg):
        model = Stack(layers=3)
    frozen = model.blocks[1].fc.weight  # a frozen, partitioned parameter inside a checkpoint
    frozen.requires_grad_(False)
    model.wrap = getattr(dslaunch.checkpointing, wrap) if wrap else None
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = dslaunch.initialize(model=model, model_parameters=trainable, config=cfg)
    torch.manual_seed(10 + rank)  # dropout: each rank its own masks, the same with or without checkpoints
    engine.backward(engine(tokens(seed=rank)))
    grads = [safe_get_full_grad(p).flatten().tolist() for p in trainable]
    whole_after = sum(p.data.numel() for p in model.parameters())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        engine.step()
    return {"grads": grads, "whole_after": whole_after, "mode": dslaunch.checkpointing.settings().mode,
            "profile": [line for line in out.getvalue().splitlines() if "activation checkpointing" in line]}


@pytest.fixture(scope="module")
def plain() -> list[dict]:
    return run_world(_zero3, 2, None, "full")


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("wrap", ["checkpoint", "non_reentrant_checkpoint"])
def test_zero3_with_frozen_and_tied_parameters_matches_no_checkpointing(wrap: str, mode: str,
                                                                       plain: list[dict]) -> None:
    """DeepSpeed's open bugs: the non-reentrant checkpoint's "saved vs recomputed metadata" with
    frozen ZeRO-3 parameters, and tied weights' "gradient computed twice"."""
    checked = run_world(_zero3, 2, wrap, mode)
    for p, c in zip(plain, checked, strict=True):
        assert c["grads"] == p["grads"]  # bitwise: float lists compared exactly
        assert c["whole_after"] == p["whole_after"] == 0  # every parameter released after backward
        assert c["mode"] == mode
    assert len(checked[0]["profile"]) == 1 and "3 forwards" in checked[0]["profile"][0]
    assert checked[1]["profile"] == [] and plain[0]["profile"] == []
