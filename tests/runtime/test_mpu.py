"""``initialize(mpu=...)``: a job whose replicas are split over several ranks (pipeline stages here,
through DeepSpeed's ``PipelineParallelGrid`` used as the mpu, as Megatron-DeepSpeed passes one).

4 gloo ranks = 2 stages x 2 data-parallel replicas; stage s holds its own piece of the model. The
engine must take the batch size, the data and ZeRO from the data-parallel group, and agree the
gradient norm over the stages: the clip factor and an fp16 overflow skip are the whole model's.
The reference is the same model trained in one process on the whole global batch."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world

pytestmark = pytest.mark.timeout(90)

LR, CLIP, STEPS, MICRO = 0.1, 0.05, 3, 2


def _piece(stage: int) -> torch.nn.Module:
    torch.manual_seed(10 + stage)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * STEPS, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def _reference() -> tuple[list[list[torch.Tensor]], list[float]]:
    """Both pieces trained together on the global batch with SGD and global-norm clipping."""
    pieces, (x, y), norms = [_piece(0), _piece(1)], _data(), []
    for k in range(STEPS):
        grads = []
        for piece in pieces:
            loss = torch.nn.functional.mse_loss(piece(x[4 * k:4 * k + 4]), y[4 * k:4 * k + 4])
            grads.append(torch.autograd.grad(loss, list(piece.parameters())))
        norm = torch.cat([g.flatten() for gs in grads for g in gs]).norm().item()
        factor = CLIP / (norm + 1e-6) if norm > CLIP else 1.0
        with torch.no_grad():
            for piece, gs in zip(pieces, grads, strict=True):
                for p, g in zip(piece.parameters(), gs, strict=True):
                    p -= LR * factor * g
        norms.append(norm)
    return [[p.detach() for p in piece.parameters()] for piece in pieces], norms


def _config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage}, **extra}


def _train_split(rank: int, world: int, zero_stage: int) -> dict:
    import dslaunch
    from dslaunch.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid
    from dslaunch.utils import groups

    dslaunch.init_distributed(verbose=False)
    grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=2))
    stage, replica = grid.get_stage_id(), grid.get_data_parallel_rank()
    x, y = _data()
    engine, *_ = dslaunch.initialize(model=_piece(stage), mpu=grid, config=_config(zero_stage),
                                     training_data=torch.utils.data.TensorDataset(x, y))
    for k in range(STEPS):
        rows = slice(4 * k + MICRO * replica, 4 * k + MICRO * (replica + 1))
        engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    first = next(iter(engine.training_dataloader))
    # plain lists: a tensor sent to the parent is shared memory that dies with this process
    return {"stage": stage, "params": [p.detach().tolist() for p in engine.module.parameters()],
            "norm": engine.get_global_grad_norm(), "batch": engine.train_batch_size(),
            "sizes": (engine.dp_world_size, engine.mp_world_size, engine.world_size, engine.global_rank),
            "groups": (groups.get_data_parallel_world_size(), groups.get_model_parallel_world_size(),
                       groups._get_data_parallel_group_ranks(), groups.get_model_parallel_rank()),
            "loader_first": first[0].tolist()}


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_stages_share_the_clip_factor_and_replicas_share_the_data(zero_stage: int) -> None:
    want, norms = _reference()
    got = run_world(_train_split, 4, zero_stage)
    for rank, r in enumerate(got):
        stage, replica = divmod(rank, 2)
        assert r["stage"] == stage and r["batch"] == 2 * MICRO  # micro x accumulation x data-parallel size
        assert r["sizes"] == (2, 2, 4, rank)
        assert r["groups"] == (2, 2, [2 * stage, 2 * stage + 1], stage)
        assert r["norm"] == pytest.approx(norms[-1], rel=1e-5)  # the whole model's norm on every stage
        for a, b in zip(r["params"], want[stage], strict=True):
            torch.testing.assert_close(torch.tensor(a), b, rtol=0, atol=1e-6)
    # the loader: both stages of a replica read the same samples, the replicas different ones
    assert got[0]["loader_first"] == got[2]["loader_first"] != got[1]["loader_first"]


def _overflow_on_one_stage(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid

    dslaunch.init_distributed(verbose=False)
    grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=2))
    cfg = _config(1, fp16={"enabled": True, "initial_scale_power": 4})
    engine, *_ = dslaunch.initialize(model=_piece(grid.get_stage_id()), mpu=grid, config=cfg)
    before = [p.detach().clone() for p in engine.module.parameters()]
    x, y = _data()
    loss = torch.nn.functional.mse_loss(engine(x[:MICRO].half()).float(), y[:MICRO])
    if grid.get_stage_id() == 1:
        loss = loss * float("inf")  # only the second stage's gradients overflow
    engine.backward(loss)
    engine.step()
    same = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
    return {"skipped": engine.skipped_steps, "unchanged": same, "scale": engine.loss_scale()}


def test_an_overflow_on_one_stage_skips_the_step_on_every_stage() -> None:
    got = run_world(_overflow_on_one_stage, 4)
    assert [r["skipped"] for r in got] == [1, 1, 1, 1]
    assert all(r["unchanged"] for r in got) and len({r["scale"] for r in got}) == 1


def _refusals(rank: int, world: int, root: str) -> dict:
    import dslaunch
    from dslaunch.errors import CheckpointError, ConfigError
    from dslaunch.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid

    messages = []
    try:
        dslaunch.initialize(model=_piece(0), mpu=object(), config=_config(0))
    except ConfigError as err:
        messages.append(str(err))
    dslaunch.init_distributed(verbose=False)
    grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=1))
    engine, *_ = dslaunch.initialize(model=_piece(grid.get_stage_id()), mpu=grid, config=_config(0))
    engine.save_checkpoint(root)  # each rank its part, by its coordinates
    weights = [p.detach().clone() for p in engine.module.parameters()]
    again, *_ = dslaunch.initialize(model=_piece(5), mpu=grid, config=_config(0))
    again.load_checkpoint(root)
    restored = all(torch.equal(a, b) for a, b in zip(weights, again.module.parameters(), strict=True))
    plain, *_ = dslaunch.initialize(model=_piece(0), config=_config(0))  # no mpu: another shape
    try:
        plain.load_checkpoint(root)
    except CheckpointError as err:
        messages.append(str(err))
    return {"messages": messages, "restored": restored}


def test_a_bad_mpu_and_a_model_parallel_checkpoint_at_another_shape_are_refused_in_one_line(tmp_path) -> None:
    for got in run_world(_refusals, 2, str(tmp_path)):
        messages = got["messages"]
        assert messages[0] == ("initialize(mpu=...): object lacks get_data_parallel_group, get_data_parallel_rank, "
                               "get_data_parallel_world_size, get_model_parallel_group, get_model_parallel_rank, "
                               "get_model_parallel_world_size; an mpu must answer Megatron's "
                               "get_{data,model}_parallel_{group,rank,world_size}")
        assert got["restored"]
        assert messages[1] == (f"{tmp_path / 'global_step0'}: a model-parallel checkpoint of a model that is no "
                               "PipelineModule loads only at its saving shape (its parts may share parameter names): "
                               "run at pipe=2, data=1, or pass load_module_strict=False for the buffers only (saved at "
                               "pipe=2, data=1; this engine: no model parallelism)")
        assert "\n" not in "".join(messages)
    names = sorted(p.name for p in (tmp_path / "global_step0").iterdir())
    assert names == ["manifest.json", "module_pipe_00.dsl", "module_pipe_01.dsl", "rank_00000.dsl", "rank_00001.dsl",
                     "zero_pipe_00-data_00.dsl", "zero_pipe_01-data_00.dsl"]
