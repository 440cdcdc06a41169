"""``runtime/parallel``: degrees checked against the world, rank lists by role, the groups behind
DeepSpeed's ``groups`` API and the pipeline grid, and no other module creating process groups."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from dslaunch.runtime.parallel.dims import ParallelDims, mpu_problem
from dslaunch.runtime.parallel.groups import ROLES, ParallelGroups
from dslaunch.runtime.parallel.topology import PipeModelDataParallelTopology, ProcessTopology
from tests.distributed import run_world

REPO = Path(__file__).resolve().parents[3]
_CREATES = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "init_device_mesh", "DeviceMesh"}


def test_only_runtime_parallel_creates_process_groups() -> None:
    """Group creation is collective in a fixed order: one module owns it (no allow-list needed)."""
    found = []
    for root in ("runtime", "launcher", "kernels", "dslaunch"):
        for path in sorted((REPO / root).rglob("*.py")):
            if path.is_relative_to(REPO / "runtime" / "parallel"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call):
                    func = node.func
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                    if name in _CREATES:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}(")
    assert found == []


def test_the_walk_sees_a_call() -> None:
    tree = ast.parse("import torch.distributed as dist\ng = dist.new_group([0, 1])\n")
    calls = [n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert calls == ["new_group"]


def test_degrees_are_checked_against_the_world_in_one_line_naming_the_keys() -> None:
    dims = ParallelDims(pipe=2, tensor=3, keys=(("pipe", "num_stages"), ("tensor", "tensor_parallel.autotp_size")))
    assert dims.problem(12) is None and dims.data(12) == 2
    assert dims.problem(8) == "num_stages=2 x tensor_parallel.autotp_size=3 must divide the world size 8"
    assert ParallelDims(pipe=0, keys=(("pipe", "num_stages"),)).problem(4) == (
        "num_stages=0: every parallel degree must be at least 1")
    assert ParallelDims(expert=3).problem(4) == (
        "expert=3 must divide the data-parallel size 4 (the world's 4 ranks / 1 per replica)")


def test_dims_topology_keeps_deepspeeds_axis_names() -> None:
    topo = ParallelDims(pipe=2, tensor=2).topology(8)
    assert topo.shape() == {"pipe": 2, "data": 2, "model": 2}
    assert topo.mapping == PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2).mapping
    assert ParallelDims().topology(4).shape() == {"pipe": 1, "data": 4}


class _Mpu:
    def __init__(self, data: int, model: int):
        self.data, self.model = data, model

    def get_data_parallel_world_size(self) -> int:
        return self.data

    def get_model_parallel_world_size(self) -> int:
        return self.model


def test_an_mpu_must_tile_the_world() -> None:
    assert mpu_problem(_Mpu(2, 2), 4) is None
    assert mpu_problem(_Mpu(2, 2), 8) is None  # Megatron: model counts tensor slices, pipe is the rest
    assert mpu_problem(_Mpu(3, 1), 4) == ("initialize(mpu=...): the mpu's get_data_parallel_world_size() 3 x "
                                          "get_model_parallel_world_size() 1 = 3 does not divide the world of 4 ranks")


def test_roles_vary_over_their_axes() -> None:
    """pipe 2 x data 2 x sequence 2 x tensor 2 (tensor fastest); expert 2 splits the data axis."""
    topo = ProcessTopology(["pipe", "data", "sequence", "model"], [2, 2, 2, 2])
    g = ParallelGroups(topo, rank=5)  # pipe 0, data 1, sequence 0, tensor 1
    assert g.ranks("tensor") == [4, 5]
    assert g.ranks("sequence") == [5, 7]
    assert g.ranks("loading") == [1, 5]
    assert g.ranks("gradient_reduce") == g.ranks("loss") == [1, 3, 5, 7]
    assert g.ranks("replica") == [4, 5, 12, 13] and g.axes("replica") == ["pipe", "model"]
    assert g.ranks("pipe") == [5, 13]
    assert (g.size("gradient_reduce"), g.rank_in("gradient_reduce")) == (4, 2)
    with pytest.raises(KeyError, match="roles: loading"):
        g.ranks("batch")
    e = ParallelGroups(ProcessTopology(["pipe", "data"], [1, 8]), rank=5, expert=2)
    assert e.ranks("expert") == [4, 5]  # DeepSpeed: expert ranks are neighbours in the data group
    assert e.ranks("expert_data") == [1, 3, 5, 7]
    assert e.ranks("loading") == list(range(8))
    assert set(ROLES) == {"loading", "gradient_reduce", "replica", "loss", "tensor", "sequence", "pipe",
                          "expert", "expert_data"}


def test_split_keeps_rank_numbers() -> None:
    topo = ProcessTopology(["pipe", "data"], [2, 4])
    split = topo.split("data", "expert_data", "expert", 2)
    assert split.shape() == {"pipe": 2, "expert_data": 2, "expert": 2}
    for rank in range(8):
        c, s = topo.get_coord(rank), split.get_coord(rank)
        assert (c.pipe, c.data) == (s.pipe, s.expert_data * 2 + s.expert)


def _world_groups(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import dslaunch
    from dslaunch.runtime.activation_checkpointing import checkpointing
    from dslaunch.runtime.pipe.topology import PipelineParallelGrid
    from dslaunch.utils import groups

    dslaunch.init_distributed(verbose=False)
    grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2))
    groups.mpu = grid
    checkpointing.configure(grid, partition_activations=True)
    policy = checkpointing._policy(checkpointing._STATE.settings)
    out = {"data": dist.get_process_group_ranks(groups._get_data_parallel_group()),
           "tensor": dist.get_process_group_ranks(groups.get_tensor_model_parallel_group()),
           "tensor_rank": groups.get_tensor_model_parallel_rank(),
           "ckpt_tensor": dist.get_process_group_ranks(policy.group),
           "loss": dist.get_process_group_ranks(grid.groups.group("loss")),
           "seq": (groups._get_sequence_parallel_world_size(), groups._get_sequence_parallel_rank()),
           "expert": (groups._get_expert_parallel_world_size(), groups._get_expert_data_parallel_world_size(),
                      dist.get_process_group_ranks(groups._get_expert_data_parallel_group())),
           "errors": []}
    for ask in (groups._get_sequence_parallel_group, groups._get_expert_parallel_group):
        try:
            ask()
        except KeyError as err:
            out["errors"].append(str(err))
    groups.mpu = None
    return out


@pytest.mark.timeout(60)
def test_groups_api_and_checkpointing_answer_from_the_grid() -> None:
    got = run_world(_world_groups, 4, timeout=50)
    for rank, r in enumerate(got):
        assert r["data"] == r["loss"] == r["expert"][2] == [rank % 2, rank % 2 + 2]
        assert r["tensor"] == r["ckpt_tensor"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert r["tensor_rank"] == rank % 2
        assert r["seq"] == (1, 0) and r["expert"][:2] == (1, 2)
        assert r["errors"] == ["'No sequence parallel group found (this job has no sequence parallelism)'",
                               "'No expert parallel group found (this job has no expert parallelism)'"]


def test_the_base_engine_does_not_import_the_pipeline_package() -> None:
    """(The config's pipeline section reads the schedule registry; the grid comes from here.)"""
    code = ("import sys, dslaunch.runtime.engine; "
            "print(sorted(m for m in sys.modules if m.startswith('dslaunch.runtime.pipe.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    # the schedule registry and the stage placement it numbers stages by (DualPipeV's V or round robin)
    assert out.stdout.strip() == "['dslaunch.runtime.pipe.placement', 'dslaunch.runtime.pipe.schedule']"
