"""DeepSpeed's ``initialize(mesh_param=(data_parallel_size, sequence_parallel_size))``: the same
groups as those two config keys, and one line when it is malformed or disagrees with the config."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import ConfigError
from tests.distributed import run_world

CONFIG = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _sizes(rank: int, world: int, mesh: tuple[int, int]) -> tuple[int, int, int]:
    import torch.distributed as dist

    import dslaunch

    engine, *_ = dslaunch.initialize(model=torch.nn.Linear(4, 4), config=dict(CONFIG), mesh_param=mesh)
    seq = 1 if engine.seq_parallel_group is None else dist.get_world_size(engine.seq_parallel_group)
    out = engine.sequence_parallel_size, seq, dist.get_world_size(engine.data_parallel_group)
    engine.destroy()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mesh", [(1, 2), (2, 1)])
def test_mesh_param_sets_the_data_and_sequence_groups(mesh: tuple[int, int]) -> None:
    dp, sp = mesh
    assert run_world(_sizes, 2, mesh) == [(sp, sp, dp)] * 2


@pytest.mark.parametrize("mesh, config, match", [
    ((2,), CONFIG, r"^initialize\(mesh_param=\(2,\)\): give \(data_parallel_size, sequence_parallel_size\)"),
    ((1, 0), CONFIG, "two integers >= 1"),
    ((1, 2), {**CONFIG, "sequence_parallel_size": 4}, r"^'sequence_parallel_size': 4, but initialize\(mesh_param"),
])
def test_a_bad_mesh_param_is_one_line(mesh: tuple, config: dict, match: str) -> None:
    import dslaunch

    with pytest.raises(ConfigError, match=match):  # before any rendezvous
        dslaunch.initialize(model=torch.nn.Linear(4, 4), config=config, mesh_param=mesh)
