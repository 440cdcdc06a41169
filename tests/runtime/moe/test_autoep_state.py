"""AutoEP's dispatch with exact counts and what a converted model saves (the custom model of
test_autoep.py, world 2, fp32): on a skewed routing the exact dispatch gives the padded one's loss
and gradients (and the unconverted model's) and moves fewer all-to-all bytes (comms logger); the
converted model's ``state_dict()`` is the unconverted model's (names, whole fused expert shapes)
and loads into it with the same output; ``save_16bit_model`` at ZeRO-3 writes that layout too.
A checkpoint saved at ``autoep_size`` 2 loads at 1 and back at 2 with every expert's master, Adam
moments and a frozen expert weight (each rank's own) as saved; zero-to-fp32 of the tag gives the
whole fused expert weights."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.distributed import run_world
from tests.runtime.moe.test_autoep import CUSTOM, EXPERTS, HIDDEN, Net


def _skewed(model: Net) -> Net:
    """Routers that send almost every (positive) token to experts 0 and 1 of 4."""
    with torch.no_grad():
        for block in model.moe:
            block.router.weight.copy_(torch.tensor([1.0, 0.5, -1.0, -1.0]).unsqueeze(1).expand(EXPERTS, HIDDEN))
    return model


def _a2a_bytes() -> int:
    from dslaunch.runtime.comm.comm import comms_logger

    return sum(size * row[0] for name, rows in comms_logger.comms_dict.items() if "all_to_all" in name
               for size, row in rows.items())


def _loss_and_grads(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(x)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _dispatch_and_state(rank: int, world: int, folder: str) -> dict:
    import torch.distributed as dist

    from dslaunch.runtime.comm.comm import comms_logger
    from dslaunch.runtime.config.expert_parallel import ExpertParallelConfig
    from dslaunch.runtime.moe.autoep import convert_for_expert_parallel

    dist.init_process_group("gloo")
    x = torch.randn(6, 3, HIDDEN, generator=torch.Generator().manual_seed(rank)).abs() + 0.5
    ref = _skewed(Net())
    model = _skewed(Net())
    convert_for_expert_parallel(model, ExpertParallelConfig(**{**CUSTOM, "autoep_size": world}))
    for module in model.modules():
        if hasattr(module, "set_deepspeed_parallelism"):
            module.set_deepspeed_parallelism()
    comms_logger.enabled = comms_logger.prof_all = True
    out: dict = {}
    for padded in (True, False):
        for block in model.moe:
            block.padded = padded
        before = _a2a_bytes()
        out[padded] = _loss_and_grads(model, x)
        out[f"bytes_{padded}"] = _a2a_bytes() - before
    comms_logger.enabled = False
    (loss, grads), (padded_loss, padded_grads) = out[False], out[True]
    diff = {"vs_padded": max(abs(loss - padded_loss), *((grads[n] - padded_grads[n]).abs().max().item() for n in grads)),
            "vs_unconverted": abs(loss - ref(x).item())}
    sd = model.state_dict()  # collective: the experts put together
    whole = Net()
    whole.load_state_dict(sd)  # strict: the unconverted model's names and shapes
    diff["reloaded"] = abs(whole(x).item() - loss)
    back = _skewed(Net())
    convert_for_expert_parallel(back, ExpertParallelConfig(**{**CUSTOM, "autoep_size": world}))
    for module in back.modules():
        if hasattr(module, "set_deepspeed_parallelism"):
            module.set_deepspeed_parallelism()
    back.load_state_dict(sd)  # the converted model takes the whole layout back (its rows)
    diff["round_trip"] = abs(back(x).item() - loss)
    return {"diff": diff, "bytes": (out["bytes_True"], out["bytes_False"]),
            "shapes": {k: tuple(v.shape) for k, v in sd.items()}, "want": {k: tuple(v.shape) for k, v in ref.state_dict().items()},
            "zero3": _zero3_export(rank, world, folder)}


def _zero3_export(rank: int, world: int, folder: str) -> float:
    """One ZeRO-3 step, then ``save_16bit_model``: the file loads into the unconverted model and
    gives the engine's loss."""
    import torch.distributed as dist

    import dslaunch as deepspeed

    config = {"train_micro_batch_size_per_gpu": 6, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                    "stage3_param_persistence_threshold": 0},  # the experts partitioned too
              "expert_parallel": {**CUSTOM, "autoep_size": world}}
    engine, *_ = deepspeed.initialize(model=Net(), config=config)
    x = torch.randn(6, 3, HIDDEN, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x))
    engine.step()
    loss = engine(x).item()
    assert engine.save_16bit_model(folder)
    dist.barrier()
    whole = Net()
    whole.load_state_dict(torch.load(Path(folder) / "pytorch_model.bin"))
    return abs(whole(x).item() - loss)


def test_exact_dispatch_equals_padded_with_fewer_bytes_and_the_saved_model_is_the_unconverted_one(tmp_path: Path) -> None:
    results = run_world(_dispatch_and_state, 2, str(tmp_path))
    for rank, got in enumerate(results):
        assert max(got["diff"].values()) <= 1e-5 and got["zero3"] <= 1e-5, f"rank {rank}: {got['diff']} {got['zero3']}"
        assert got["shapes"] == got["want"], f"rank {rank}: {got['shapes']}"
    padded, exact = (sum(got["bytes"][i] for got in results) for i in (0, 1))
    # over the group every route's row crosses 4 times a layer (dispatch, combine, both backward; the
    # first layer's dispatch has no backward: the input needs no gradient), plus the counts (4 int64
    # per rank a layer): nothing padded
    routes, row = 2 * 6 * 3 * 2, HIDDEN * 4
    assert exact == (3 + 4) * routes * row + 2 * 2 * EXPERTS * 8, exact
    assert exact <= 0.75 * padded, f"all-to-all bytes: exact {exact}, padded {padded}"


def _experts_now(engine: object) -> dict[str, torch.Tensor]:
    """Every expert's fp32 master and Adam moments (trained weights) or value (frozen), whole."""
    from dslaunch.runtime.moe.autoep import AutoEPMoE
    from dslaunch.runtime.moe.autoep_state import whole_rows
    from dslaunch.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for prefix, layer in engine.module.named_modules():
        if isinstance(layer, AutoEPMoE):
            for name, p in layer.experts.named_parameters():
                values = {"value": p.detach().float()} if not p.requires_grad else {
                    "master": safe_get_full_fp32_param(p), "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
                    "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq")}
                for what, v in values.items():
                    out[f"{prefix}.{name}.{what}"] = whole_rows(v, layer.ep_group, layer.ep_size)
    return out


def _engine(ep: int, fresh: bool) -> object:
    import dslaunch as deepspeed

    config = {"train_micro_batch_size_per_gpu": 6, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 2}, "expert_parallel": {**CUSTOM, "autoep_size": ep}}
    net = Net()
    if not fresh:  # a model that is not the saved one until the load
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
    net.moe[1].mlp_experts.down_proj.requires_grad_(False)  # a frozen expert weight
    return deepspeed.initialize(model=net, config=config)[0]


def _resume(rank: int, world: int, folder: str) -> dict:
    """Two Adam steps at ep 2, saved; loaded at ep 1, saved again; loaded at ep 2."""
    saved = _engine(world, True)
    for step in range(2):
        x = torch.randn(6, 3, HIDDEN, generator=torch.Generator().manual_seed(10 * step + rank))
        saved.backward(saved(x))
        saved.step()
    want = _experts_now(saved)
    saved.save_checkpoint(f"{folder}/ep{world}", tag="t")
    from dslaunch.runtime.checkpoint.export import get_fp32_state_dict_from_zero_checkpoint

    fp32 = get_fp32_state_dict_from_zero_checkpoint(f"{folder}/ep{world}", tag="t")  # the rows stacked back
    worst = {"fp32": max((fp32[f"moe.{i}.experts.gate_up_proj"] - want[f"moe.{i}.gate_up_proj.master"]).abs().max().item()
                         for i in (0, 1))}
    for ep, source in ((1, f"{folder}/ep{world}"), (world, f"{folder}/ep1")):
        engine = _engine(ep, False)
        engine.load_checkpoint(source, tag="t")
        got = _experts_now(engine)
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        worst[ep] = max((got[k] - want[k]).abs().max().item() for k in want)
        if ep == 1:
            engine.save_checkpoint(f"{folder}/ep1", tag="t")
    frozen = want["moe.1.down_proj.value"]  # each rank's half differs: a rank-0-only save would lose one
    return {"worst": worst, "frozen_differs": bool((frozen[:2] - frozen[2:]).abs().max() > 0)}


def test_resume_at_another_autoep_size_restores_every_expert_and_its_adam_moments(tmp_path: Path) -> None:
    for rank, got in enumerate(run_world(_resume, 2, str(tmp_path))):
        assert got["worst"] == {"fp32": 0.0, 1: 0.0, 2: 0.0} and got["frozen_differs"], f"rank {rank}: {got}"


def _moe_frozen(rank: int, world: int, folder: str) -> float:
    """A deepspeed.moe layer at ep 2 with a frozen expert weight and an expert buffer (each rank's
    own values), saved and loaded into a model whose values differ: each rank gets its own back."""
    import dslaunch as deepspeed
    from dslaunch.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from tests.runtime.moe.models import MoECase, TinyMoENet

    def engine(fill: float | None) -> tuple[object, list[torch.Tensor]]:
        model = TinyMoENet(MoECase(1, False, False), world)
        model.set_expert_weights(rank * model.moe.num_local_experts)
        for j, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
            expert[0].weight.requires_grad_(False)
            expert.register_buffer("seen", torch.full((3,), float(10 * rank + j)))
            if fill is not None:
                with torch.no_grad():
                    expert[0].weight.fill_(fill)
                    expert.seen.fill_(fill)
        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in model.parameters() if p.requires_grad], "name": "p"})
        config = {"train_micro_batch_size_per_gpu": 16, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
                  "zero_optimization": {"stage": 2}}
        eng = deepspeed.initialize(model=model, model_parameters=params, config=config)[0]
        experts = model.moe.deepspeed_moe.experts.deepspeed_experts
        return eng, [t.detach().clone() for e in experts for t in (e[0].weight, e.seen)]

    saved, want = engine(None)
    saved.save_checkpoint(folder, tag="t")
    loaded, before = engine(0.0)
    loaded.load_checkpoint(folder, tag="t")
    experts = loaded.module.moe.deepspeed_moe.experts.deepspeed_experts
    got = [t for e in experts for t in (e[0].weight, e.seen)]
    assert max((a - b).abs().max().item() for a, b in zip(before, want, strict=True)) > 0
    return max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))


def test_each_ranks_frozen_experts_and_expert_buffers_survive_a_checkpoint(tmp_path: Path) -> None:
    assert run_world(_moe_frozen, 2, str(tmp_path)) == [0.0, 0.0]
