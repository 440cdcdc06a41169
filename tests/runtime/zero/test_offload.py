"""CPU offload (``offload_optimizer``/``offload_param`` with device cpu) trains like plain torch.

On this CPU-only machine host memory *is* the device, so these runs check the configuration, the
placement of the master/optimizer state/shards in host memory and the numerics of the offload
path (gradients moved to the master's device, the update there, the copy back); the transfers
themselves only happen on GPU hosts.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_world
from tests.runtime.zero.equivalence import assert_close, config, engine_losses


def _offload(stage: int, params: bool = False) -> dict:
    cfg = config(stage)
    zero = cfg["zero_optimization"]
    zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if params:
        zero.update(offload_param={"device": "cpu"}, stage3_param_persistence_threshold=0)
    return cfg


def _train_and_place(rank: int, world: int, cfgs: list[dict]) -> list[list[float]]:
    out = [engine_losses(rank, world, cfg) for cfg in cfgs]
    import torch

    import dslaunch
    from tests.runtime.models import batches, make_model

    engine, *_ = dslaunch.initialize(model=make_model(), config=cfgs[-1])
    tokens, labels = batches(1, world)[0]
    for _ in range(engine.gradient_accumulation_steps()):  # up to the first optimizer step
        engine.backward(engine(tokens[rank:rank + 1], labels[rank:rank + 1]))
        engine.step()
    for g in engine.zero.groups:
        assert g.master.device == torch.device("cpu")
        state = engine.optimizer.state[g.master]
        assert {"exp_avg", "exp_avg_sq"} <= set(state)
        assert all(t.device == torch.device("cpu") for t in state.values())
        assert g.shard.device == torch.device("cpu")
    return out


@pytest.mark.timeout(120)
def test_cpu_offload_matches_single_process(reference: list[float]) -> None:
    """Stages 1, 2, 3 with offload_optimizer and stage 3 with offload_param too, 2 ranks."""
    cfgs = [_offload(1), _offload(2), _offload(3), _offload(3, params=True)]
    for per_rank in run_world(_train_and_place, 2, cfgs):
        for losses in per_rank:
            assert_close(losses, reference, 1e-5)


def _buckets_of_a_large_shard(rank: int, world: int) -> tuple[int, int]:
    import torch

    import dslaunch
    from dslaunch.runtime.zero.offload.step import MAX_BUCKET_NUMEL

    torch.manual_seed(0)
    model = torch.nn.Linear(MAX_BUCKET_NUMEL // 4096 + 1, 4096, bias=False)  # just over one bucket
    cfg = _offload(2)
    cfg["zero_optimization"]["sub_group_size"] = 10**9  # DeepSpeed's default, written out as HF's configs do
    cfg["gradient_accumulation_steps"] = 1
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    engine.backward(engine(torch.ones(1, model.in_features)).square().mean())
    engine.step()
    return len(engine.zero.offload.buckets), engine.zero.offload.bucket_numel


@pytest.mark.timeout(60)
def test_a_large_sub_group_is_cut_into_buckets_that_pipeline() -> None:
    """sub_group_size 1e9 over a shard of MAX_BUCKET_NUMEL + 4096 elements: two buckets, the first full."""
    from dslaunch.runtime.zero.offload.step import MAX_BUCKET_NUMEL

    assert run_world(_buckets_of_a_large_shard, 1) == [(2, MAX_BUCKET_NUMEL)]


def _phases(rank: int, world: int) -> list[dict]:
    import torch

    import dslaunch
    from dslaunch.runtime.zero.offload.phases import PHASES

    out = []
    for bf16 in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
        cfg = {"train_batch_size": 4, "steps_per_print": 100, "gradient_clipping": 1.0,
               "bf16": {"enabled": bf16}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                     "sub_group_size": 1000}}  # several buckets
        engine, *_ = dslaunch.initialize(model=model, config=cfg)
        x = torch.randn(4, 32)
        for _ in range(2):
            engine.backward(engine(x.to(engine.module[0].weight.dtype)).float().square().mean())
            engine.step()
        phases = engine.zero.offload.phases
        out.append({"keys": tuple(phases.ms) == PHASES, "update": phases.ms["update"] > 0,
                    "norm": phases.ms["norm"] > 0, "overhead": phases.overhead_ms >= 0,
                    "grad_bytes": phases.grad_bytes, "param_bytes": phases.param_bytes})
    return out


@pytest.mark.timeout(60)
def test_offloaded_step_phases_and_bytes_moved_on_a_cpu_host() -> None:
    """Every phase is timed; on a CPU host the gradients are read where they are and the update's
    own pass writes the 16-bit model (bf16) or is the model (fp32): no copy moves a byte."""
    (runs,) = run_world(_phases, 1)
    for r in runs:
        assert r == {"keys": True, "update": True, "norm": True, "overhead": True,
                     "grad_bytes": 0, "param_bytes": 0}
