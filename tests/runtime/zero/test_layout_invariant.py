"""``layout_invariant`` on the data-parallel side (gloo, fp32, ZeRO-2): gradients summed over ranks
and micro steps in one fixed pairwise tree, so one global batch gives the same bits at world 1,
2 and 4; and what the mode cannot keep invariant is refused in one line. (The MoE side and the
resume at another layout: tests/runtime/checkpoint/test_experts.py.)"""

from __future__ import annotations

import pytest

from tests.distributed import run_world

SLOTS, STEPS = 4, 2  # micro batches in the global batch; optimizer steps


def _tree(rank: int, world: int) -> list:
    """Every rank's ``TreeAllReduce`` of its own vector (values whose sums round differently in
    another order), as numpy."""
    import torch
    import torch.distributed as dist

    from dslaunch.runtime.zero.exchange import TreeAllReduce

    dist.init_process_group("gloo", rank=rank, world_size=world)
    buf = torch.tensor([1.0, 2.0 ** 24, 0.1, 3.0]) * torch.tensor([1.0, (-1.0) ** rank, rank + 1.0, 1e-8 ** rank])
    handle = TreeAllReduce().all_reduce(buf)
    assert not handle.is_completed()  # the rounds wait for the reducer's flush
    handle.wait()
    dist.destroy_process_group()
    return buf.numpy().tolist()


def test_tree_all_reduce_is_the_pairwise_tree_on_every_rank() -> None:
    import torch

    got = run_world(_tree, 4, timeout=60)
    rows = [torch.tensor([1.0, 2.0 ** 24, 0.1, 3.0]) * torch.tensor([1.0, (-1.0) ** r, r + 1.0, 1e-8 ** r])
            for r in range(4)]
    want = ((rows[0] + rows[1]) + (rows[2] + rows[3])).tolist()
    assert all(g == want for g in got), (got, want)


def _train(rank: int, world: int, extra: dict) -> list:
    """``STEPS`` ZeRO-2 steps of a small MLP on the global batch of ``SLOTS`` micro batches (slot
    ``j * world + rank`` at micro step ``j``); the final weights, as lists."""
    import torch

    import dslaunch as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": SLOTS // world,
              "steps_per_print": 1000, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "gradient_clipping": 0.5, "zero_optimization": {"stage": 2}, **extra}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(STEPS):
        for j in range(SLOTS // world):
            gen = torch.Generator().manual_seed(100 * step + j * world + rank)
            x, y = torch.randn(8, 16, generator=gen) * 3, torch.randint(0, 3, (8,), generator=gen)
            engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
            engine.step()
    return [p.detach().tolist() for p in model.parameters()]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [1, 2])
def test_one_global_batch_gives_the_same_bits_at_world_1_and_4(stage: int) -> None:
    """World 1 accumulating 4 micro steps (the binary counter's tree) against world 4 in one (the
    recursive doubling; world 2, both, is the MoE test's); without the mode world 1's chain differs.
    Stage 1 reduces every micro step as stage 2 does under the mode (its boundary sum could not)."""
    on = {"layout_invariant": {"enabled": True}, "zero_optimization": {"stage": stage}}
    one, four = (run_world(_train, w, on, timeout=150)[0] for w in (1, 4))
    assert one == four
    if stage == 2:
        assert run_world(_train, 1, {}, timeout=150)[0] != four  # the test can see a chain


@pytest.mark.parametrize(("extra", "key"), [
    ({"zero_optimization": {"stage": 3}}, "'zero_optimization.stage': 3: layout_invariant"),
    ({"gradient_accumulation_steps": 3, "train_batch_size": 24}, "'gradient_accumulation_steps': 3"),
    ({"use_data_before_expert_parallelism": True}, "'use_data_before_expert_parallelism': true"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 0.01}}}, "'layout_invariant.enabled': true: .*1-bit"),
    ({"expert_parallel": {"enabled": True}}, "'layout_invariant.enabled': true with expert_parallel"),
])
def test_what_cannot_be_invariant_is_refused_in_one_line(extra: dict, key: str) -> None:
    """At load, from the config alone: every rank refuses alike before any group exists."""
    from dslaunch.errors import ConfigError
    from dslaunch.runtime.config.ds_config import load_config

    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 2}, "layout_invariant": {"enabled": True}, **extra}
    with pytest.raises(ConfigError, match=key) as err:
        load_config(config, 1)
    assert "\n" not in str(err.value)
    load_config({**config, "layout_invariant": {"enabled": False}}, 1)  # the mode is what refuses


def test_the_engine_loader_gives_a_rank_the_same_micro_batch_at_any_world_size() -> None:
    """Under the mode (``blocked``) rank ``r``'s ``j``-th batch at world ``W`` is micro batch
    ``j * W + r`` of the epoch, whatever ``W``; the default interleaving is not."""
    from dslaunch.runtime.dataloader import DistributedDataLoader

    def batches(world: int, blocked: bool) -> dict[int, list[int]]:
        out = {}
        for rank in range(world):
            loader = DistributedDataLoader(list(range(64)), 4, rank, world, collate_fn=list, blocked=blocked)
            out.update({j * world + rank: b for j, b in enumerate(loader)})
        return out

    assert batches(1, True) == batches(2, True) == batches(4, True)
    assert batches(2, False) != batches(4, False)
