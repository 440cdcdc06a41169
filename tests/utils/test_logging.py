"""``deepspeed.utils.logger``/``log_dist``, ``groups`` and the ZeRO-3 leaf flags."""

from __future__ import annotations

import logging

import pytest
import torch

from dslaunch.utils import groups, log_dist, logger, set_z3_leaf_modules
from dslaunch.utils.z3_leaf_module import get_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
from tests.distributed import run_world


def test_logger_is_deepspeeds() -> None:
    assert logger.name == "DeepSpeed" and logger.level == logging.WARNING and not logger.propagate


def test_log_dist_without_a_group_logs_as_rank_minus_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # whatever group an earlier test of this worker process left: this is the no-group branch
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        log_dist("hello", ranks=[0])
        log_dist("quiet", ranks=[0], level=logging.DEBUG)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.WARNING)
    assert seen == ["[Rank -1] hello"]


def _dist_messages(rank: int, world: int) -> list:
    import torch.distributed as dist

    from dslaunch.utils.logging import get_dist_msg

    dist.init_process_group("gloo")
    return [get_dist_msg("m", [0]), get_dist_msg("m", [-1]), get_dist_msg("m"),
            groups._get_data_parallel_world_size(), groups._get_data_parallel_rank(),
            groups._get_sequence_parallel_world_size()]


@pytest.mark.timeout(60)
def test_log_dist_picks_ranks_and_groups_are_data_parallel() -> None:
    r0, r1 = run_world(_dist_messages, 2)
    assert r0 == ["[Rank 0] m", "[Rank 0] m", None, 2, 0, 1]
    assert r1 == [None, "[Rank 1] m", None, 2, 1, 1]
    with pytest.raises(KeyError):
        groups._get_sequence_parallel_group()


def test_z3_leaf_flags_by_class_and_name() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    assert len(set_z3_leaf_modules(model, [torch.nn.Linear])) == 2
    assert get_z3_leaf_modules(model) == [model[0], model[2]]
    unset_z3_leaf_modules(model, ["torch.nn.modules.linear.Linear"])
    assert not any(z3_leaf_module(m) for m in model.modules())
    with pytest.raises(ValueError, match="No modules of type"):
        set_z3_leaf_modules(model, ["Conv2d"])
