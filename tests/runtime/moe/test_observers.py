"""What the observers see of an MoE model trained through ``deepspeed.initialize`` (gloo, world 2,
ep 2: the path of ``scripts/bench/moe_bench.py``): the engine numbers the MoE layers as DeepSpeed
does (their wait marks for the hang monitor name the layer: ``tests/launcher/monitor/test_blame_moe.py``);
the comms logger counts four all-to-alls a layer and step, of the dispatch buffer's bytes; and the
memory estimate with ``expert_parallel=2`` is within 10% of the bytes the engine holds."""

from __future__ import annotations

import pytest

from tests.distributed import run_world

HIDDEN, EXPERTS, TOKENS, WIDE = 8, 4, 16, 64
TOLERANCE = 0.10


def _net(hidden: int, ep: int):
    import torch

    from dslaunch.moe.layer import MoE

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            expert = torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.Linear(2 * hidden, hidden))
            self.inp = torch.nn.Linear(hidden, hidden)
            self.dense = MoE(hidden, torch.nn.Linear(hidden, hidden), num_experts=2, ep_size=1, min_capacity=0)
            self.spread = MoE(hidden, expert, num_experts=EXPERTS, ep_size=ep, min_capacity=0)

        def forward(self, x):
            h, _, _ = self.dense(self.inp(x))
            return self.spread(h)[0]

    return Net()


def _train(rank: int, world: int) -> dict:
    import torch

    import dslaunch as deepspeed
    from dslaunch import comm
    from dslaunch.utils import groups
    from tests.runtime.estimate.peak import engine_peak

    model = _net(HIDDEN, 2)
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000, "comms_logger": {"enabled": True},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    comm.comms_logger.reset()
    engine.backward(engine(torch.randn(TOKENS, HIDDEN)).square().mean())
    engine.step()
    counted = {size: row[0] for size, row in comm.comms_logger.get_raw_data().get("all_to_all_single", {}).items()}
    comm.comms_logger.enabled = False
    # gloo: the shared-memory slots are a fixed cost per group (test_shm.py), not in the estimate
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "shared_memory_collectives": "never",
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    peak = engine_peak(_net(WIDE, 2), config, lambda dtype: torch.randn(TOKENS, WIDE, dtype=dtype), steps=1)
    groups.grid = None
    return {"ids": [model.dense.deepspeed_moe.layer_id, model.spread.deepspeed_moe.layer_id],
            "all_to_all": counted, "peak": peak}


@pytest.mark.timeout(120)
def test_layers_are_numbered_their_all_to_alls_counted_and_their_memory_estimated() -> None:
    import torch

    from dslaunch.runtime.estimate import TrainingSetup, estimate_memory, from_module

    with torch.device("meta"):
        shape = from_module(_net(WIDE, 2))
    est = estimate_memory(shape, TrainingSetup(stage=1, gpus_per_node=2, expert_parallel=2, accelerator="cpu",
                                               shared_memory=False))  # the engine's config says "never"
    capacity = TOKENS // EXPERTS  # ceil(16 tokens / 4 experts x capacity factor 1.0)
    for got in run_world(_train, 2):
        assert got["ids"] == [0, 1], got
        assert got["all_to_all"] == {EXPERTS * capacity * HIDDEN * 4: 4}, got  # fp32 [E, C, M], 2 + 2 a step
        assert abs(est.rank_bytes - got["peak"]) <= TOLERANCE * got["peak"], (est.rank_bytes, got["peak"], est.device)
