"""Checkpoint on request (``runtime.preempt``): one rank gets the signal, every rank saves the same
step and leaves with ``PREEMPTED_EXIT_CODE``; without the launcher's arming nothing changes."""

from __future__ import annotations

import os

import pytest

from dslaunch.utils.beat import CHECKPOINT_SIGNAL
from dslaunch.utils.restart import CHECKPOINT_ON_REQUEST, PREEMPTED_EXIT_CODE, RESUME_FROM
from tests.distributed import run_world

pytestmark = pytest.mark.timeout(120)


def _train(rank: int, world: int, ckpt: str, armed: bool) -> tuple[object, int, int | None]:
    import torch
    from torch import nn

    import dslaunch
    from dslaunch.runtime import preempt

    os.environ[RESUME_FROM] = ckpt
    if armed:
        os.environ[CHECKPOINT_ON_REQUEST] = "1"
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "dist_init_timeout": 60}
    engine, _, _, _ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(2, 4)
    for step in range(1, 8):
        engine.backward(engine(x).pow(2).mean())
        if rank == 1 and step == 3:
            os.kill(os.getpid(), CHECKPOINT_SIGNAL)  # what the node agent sends (rank 1 only)
        try:
            engine.step()
        except SystemExit as exc:
            return exc.code, engine.global_steps, preempt.armed_signal()
    return None, engine.global_steps, preempt.armed_signal()


def test_one_ranks_request_checkpoints_every_rank_at_the_same_step(tmp_path):
    results = run_world(_train, 2, str(tmp_path), True)
    assert results == [(PREEMPTED_EXIT_CODE, 3, int(CHECKPOINT_SIGNAL))] * 2
    assert (tmp_path / "latest").read_text().strip() == "global_step3"


def test_unarmed_the_signal_is_not_taken(tmp_path):
    # Not armed: the worker does not announce the signal, so no agent sends it; here it would kill
    # the rank (SIGUSR1's default), so the test only checks what the heartbeat would announce.
    assert run_world(_train_unsignalled, 1, str(tmp_path)) == [(None, 7, None)]
    assert not (tmp_path / "latest").exists()


def _train_unsignalled(rank: int, world: int, ckpt: str) -> tuple[object, int, int | None]:
    os.environ.pop(CHECKPOINT_ON_REQUEST, None)
    return _train(2, world, ckpt, False)  # rank "2": never signals itself
