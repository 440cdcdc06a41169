"""``ProcessTopology`` and its subclasses against DeepSpeed's documented results, and the process
groups of ``PipelineParallelGrid`` on real gloo ranks (who is in which group, and that collectives
on each group reach exactly those ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dslaunch.errors import UsageError
from dslaunch.runtime.pipe.topology import (
    DataParallelGrid,
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from tests.distributed import run_world

pytestmark = pytest.mark.timeout(60)


def test_ranks_are_row_major_over_the_axes() -> None:
    topo = ProcessTopology(axes=["a", "b", "c"], dims=[2, 3, 2])
    assert topo.world_size() == 12 and topo.get_axis_names() == ["a", "b", "c"]
    assert [tuple(topo.get_coord(r)) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert all(topo.get_rank(**topo.get_coord(r)._asdict()) == r for r in range(12))
    assert topo.get_rank(a=1, b=2, c=1) == 11 and topo.get_coord(11).b == 2
    assert topo.get_dim("b") == 3 and topo.get_dim("nope") == 0
    assert topo.shape() == {"a": 2, "b": 3, "c": 2}


def test_pipe_model_data_comm_lists_are_deepspeeds() -> None:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("jeff") == []
    assert topo.filter_match(pipe=0, data=1) == [2, 3] and topo.filter_match(model=1) == [1, 3, 5, 7]
    assert topo.get_axis_list("pipe", 1) == [4, 5, 6, 7]
    assert topo.get_rank_repr(3) == "model_01" and topo.get_rank_repr(3, omit_axes=[]) == "pipe_00-data_01-model_01"
    pd = PipeDataParallelTopology(num_pp=3, num_dp=2)
    assert pd.get_axis_comm_lists("pipe") == [[0, 2, 4], [1, 3, 5]] and pd.get_rank_repr(5) == ""


@pytest.mark.parametrize("axes, dims", [(["a", "a"], [1, 2]), (["a"], [1, 2]), (["a", "b"], [2, 0]),
                                        (["a b"], [2])])
def test_a_bad_topology_is_one_error(axes: list[str], dims: list[int]) -> None:
    with pytest.raises(UsageError, match="^ProcessTopology: "):
        ProcessTopology(axes, dims)


def test_bad_lookups_say_what_is_wrong() -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    with pytest.raises(ValueError, match="needs every axis"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="outside the topology"):
        topo.get_rank(pipe=2, data=0)
    with pytest.raises(ValueError, match="rank 4 not found"):
        topo.get_coord(4)


def _groups(rank: int, world: int, dims: tuple[int, int, int]) -> dict:
    dist.init_process_group("gloo")
    grid = PipelineParallelGrid(PipeModelDataParallelTopology(*dims))

    def members(group) -> list[int]:
        # a collective on the group: each member contributes 2**rank, the sum names the members
        t = torch.tensor([2 ** rank], dtype=torch.int64)
        dist.all_reduce(t, group=group)
        return [r for r in range(world) if int(t) >> r & 1]

    return {"stage": grid.get_stage_id(), "dp": (grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()),
            "mp": (grid.get_model_parallel_rank(), grid.get_model_parallel_world_size()),
            "slice": (grid.get_slice_parallel_rank(), grid.get_slice_parallel_world_size()),
            "dp_members": members(grid.get_data_parallel_group()),
            "mp_members": members(grid.get_model_parallel_group()),
            "pipe_members": members(grid.get_pipe_parallel_group()),
            "slice_members": members(grid.get_slice_parallel_group()),
            "first_last": (grid.is_first_stage, grid.is_last_stage), "next": grid.stage_to_global(grid.pipe_parallel_size - 1 - grid.stage_id),
            "valid": grid._is_grid_valid(), "rank_lists": (grid.pp_group, grid.dp_group)}


def test_the_grid_groups_reach_exactly_their_ranks() -> None:
    # 2 stages x 2 replicas, no tensor slices: rank = pipe * 2 + data
    got = run_world(_groups, 4, (2, 1, 2))
    for rank, g in enumerate(got):
        pipe, data = divmod(rank, 2)
        assert g["stage"] == pipe and g["dp"] == (data, 2) and g["first_last"] == (pipe == 0, pipe == 1)
        assert g["dp_members"] == [pipe * 2, pipe * 2 + 1]
        assert g["mp_members"] == g["pipe_members"] == [data, 2 + data] and g["mp"] == (pipe, 2)
        assert g["slice_members"] == [rank] and g["slice"] == (0, 1)
        assert g["next"] == (1 - pipe) * 2 + data
        # DeepSpeed's names: the rank lists beside the groups, and its grid check (its tests call it)
        assert g["valid"] and g["rank_lists"] == (g["pipe_members"], g["dp_members"])


def test_tensor_slices_are_the_fastest_axis() -> None:
    got = run_world(_groups, 4, (1, 2, 2))  # 1 stage, 2 slices, 2 replicas: rank = data * 2 + model
    for rank, g in enumerate(got):
        data, model = divmod(rank, 2)
        assert g["slice"] == (model, 2) and g["slice_members"] == [data * 2, data * 2 + 1]
        assert g["mp_members"] == g["slice_members"] and g["dp_members"] == [model, 2 + model]
        assert g["pipe_members"] == [rank]


def _sizes(rank: int, world: int) -> tuple:
    dist.init_process_group("gloo")
    try:
        PipelineParallelGrid(PipeDataParallelTopology(num_pp=3, num_dp=1))
    except UsageError as err:
        error = str(err)
    default = PipelineParallelGrid()  # DeepSpeed's factoring of the world: 2 -> 2 stages
    dp = DataParallelGrid()
    return (error, default.pipe_parallel_size, default.data_parallel_size,
            dp.get_data_parallel_group(), dp.get_data_parallel_rank(), dp.get_model_parallel_world_size())


def test_a_topology_of_another_size_is_refused_and_the_default_factors_the_world() -> None:
    for rank, (error, pp, dp, group, dp_rank, mp) in enumerate(run_world(_sizes, 2)):
        assert error == "the topology has 3 ranks ({'pipe': 3, 'data': 1}) but the world has 2"
        assert (pp, dp) == (2, 1)
        assert group is None and dp_rank == rank and mp == 1  # the world group: nothing created
