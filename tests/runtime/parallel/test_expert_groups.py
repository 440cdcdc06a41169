"""DeepSpeed's expert-group API by name (``deepspeed.utils.groups``): the rank layout of DeepSpeed's
groups for each expert-parallel size, with and without an mpu, and the engine asking modules to
make theirs."""

from __future__ import annotations

import pytest

from tests.distributed import run_world

# DeepSpeed's layout (deepspeed/utils/groups.py, _create_expert_and_data_parallel) for world 4, no
# pipeline: E + D by default, D + E with use_data_before_expert_parallel_.
LAYOUT = {
    1: ([[0], [1], [2], [3]], [[0, 1, 2, 3]] * 4),
    2: ([[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),
    4: ([[0, 1, 2, 3]] * 4, [[0], [1], [2], [3]]),
}


def _answers(name: str) -> dict:
    import torch.distributed as dist

    from dslaunch.utils import groups

    return {"expert": dist.get_process_group_ranks(groups._get_expert_parallel_group(name)),
            "expert_data": dist.get_process_group_ranks(groups._get_expert_data_parallel_group(name)),
            "sizes": (groups._get_expert_parallel_world_size(name), groups._get_expert_data_parallel_world_size(name)),
            "ranks": (groups._get_expert_parallel_rank(name), groups._get_expert_data_parallel_rank(name))}


def _without_mpu(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.utils import groups

    dslaunch.init_distributed(verbose=False)
    out: dict = {"before": (groups._get_expert_parallel_group_dict(), groups._get_max_expert_size())}
    for size in (2, 1, 4):
        groups._create_expert_and_data_parallel(size)
    groups._create_expert_and_data_parallel(2, use_data_before_expert_parallel_=True)  # made: a no-op
    out.update({n: _answers(f"ep_size_{n}") for n in (1, 2, 4)})
    out["names"] = (sorted(groups._get_expert_parallel_group_dict()),
                    sorted(groups._get_expert_data_parallel_group_dict()), groups._get_max_expert_size())
    try:
        groups._get_expert_parallel_group("ep_size_8")
    except KeyError as err:
        out["unknown"] = str(err)
    groups.grid = None
    return out


@pytest.mark.timeout(90)
def test_expert_groups_by_name_match_deepspeeds_layout_without_an_mpu() -> None:
    for rank, got in enumerate(run_world(_without_mpu, 4, timeout=80)):
        assert got["before"] == ({}, None)
        for size, (expert, expert_data) in LAYOUT.items():
            assert got[size]["expert"] == expert[rank] and got[size]["expert_data"] == expert_data[rank]
            assert got[size]["sizes"] == (size, 4 // size)
            assert got[size]["ranks"] == (expert[rank].index(rank), expert_data[rank].index(rank))
        assert got["names"] == (["ep_size_1", "ep_size_2", "ep_size_4"], ["ep_size_1", "ep_size_2", "ep_size_4"], 4)
        assert got["unknown"].startswith("\"expert parallel group 'ep_size_8' is not initialized (made: [1, 2, 4])")


def _data_before_expert_and_pipeline(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.runtime.parallel.topology import PipeDataParallelTopology
    from dslaunch.runtime.pipe.topology import PipelineParallelGrid
    from dslaunch.utils import groups

    dslaunch.init_distributed(verbose=False)
    groups._create_expert_and_data_parallel(2, use_data_before_expert_parallel_=True)
    out = {"d_e": _answers("ep_size_2")}
    groups.grid = None
    groups.mpu = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=2))
    groups._create_expert_and_data_parallel(2)
    out["pipe"] = _answers("ep_size_2")
    try:
        groups._create_expert_and_data_parallel(4)
    except Exception as err:  # noqa: BLE001 (the message is what is checked)
        out["too_big"] = f"{type(err).__name__}: {err}"
    groups.mpu = None
    return out


@pytest.mark.timeout(90)
def test_data_before_expert_and_a_pipeline_grid_split_as_deepspeed_does() -> None:
    for rank, got in enumerate(run_world(_data_before_expert_and_pipeline, 4, timeout=80)):
        assert got["d_e"]["expert"] == [[0, 2], [1, 3]][rank % 2]
        assert got["d_e"]["expert_data"] == [[0, 1], [2, 3]][rank // 2]
        # pipe 2 x data 2: each stage's two data ranks hold different experts
        assert got["pipe"]["expert"] == [[0, 1], [2, 3]][rank // 2]
        assert got["pipe"]["expert_data"] == [rank] and got["pipe"]["sizes"] == (2, 1)
        assert got["too_big"] == "UsageError: expert parallel size 4 must divide the data-parallel size 2"


def _engine_asks_modules(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    import dslaunch
    from dslaunch.utils import groups

    class Layer(torch.nn.Linear):
        """Makes its expert groups when the engine asks, as DeepSpeed's MoE layer does."""

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            self.asked = use_data_before_expert_parallel_
            groups._create_expert_and_data_parallel(2, use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    dslaunch.init_distributed(verbose=False)
    model = torch.nn.Sequential(Layer(2, 2))
    engine, *_ = dslaunch.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                          "use_data_before_expert_parallelism": True,
                                                          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    out = {"asked": model[0].asked, "expert_data": dist.get_process_group_ranks(
        groups._get_expert_data_parallel_group("ep_size_2")), "grid": groups.grid is engine.grid}
    groups.grid = None
    return out


@pytest.mark.timeout(90)
def test_the_engine_asks_every_module_to_make_its_expert_groups() -> None:
    for rank, got in enumerate(run_world(_engine_asks_modules, 4, timeout=80)):
        assert got == {"asked": True, "expert_data": [[0, 1], [2, 3]][rank // 2], "grid": True}


def test_deepspeeds_groups_name_is_the_implementing_module_and_shares_its_globals() -> None:
    from dslaunch.runtime.parallel import deepspeed_groups
    from dslaunch.utils import groups

    assert groups is deepspeed_groups  # one module: the engine's writes of grid/mpu are what users read
    before = groups.grid
    try:
        groups.grid = marker = object()
        assert deepspeed_groups.grid is marker
    finally:
        groups.grid = before
