"""Saving DeepSpeed's format (``"checkpoint": {"format": "deepspeed"}``) through dslaunch's own save
protocol: each tag is published atomically with a manifest, ``latest`` last; ``async_save`` and
``keep_last`` act as they do on dslaunch's format; a save killed before it publishes leaves the
previous tag and ``latest`` loadable. (Real DeepSpeed loading these files: test_deepspeed_interop.)"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from dslaunch.runtime.checkpoint.deepspeed_layout import deepspeed_tag
from tests.distributed import _CTX, free_port, run_world
from tests.runtime.checkpoint import deepspeed_job

CKPT = {"format": "deepspeed", "async_save": True, "keep_last": 2}


def _engine(world: int, checkpoint: dict):
    import dslaunch

    net = deepspeed_job.model()
    return dslaunch.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=0.01),
                               config=deepspeed_job.config(2, world, checkpoint=checkpoint))[0]


def _train(engine, rank: int, world: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = deepspeed_job.batch(step, rank, world)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _save_async_rotate_load(rank: int, world: int, root: str) -> dict:
    import dslaunch

    engine = _engine(world, CKPT)
    for step in range(3):  # global_step1..3; keep_last 2 drops global_step1
        _train(engine, rank, world, range(step, step + 1))
        engine.save_checkpoint(root)
    saved = deepspeed_job.full_state(dslaunch, engine)
    engine.wait_for_checkpoint()
    ours = _train(engine, rank, world, range(3, 6))
    fresh = _engine(world, {"format": "deepspeed"})
    path, _ = fresh.load_checkpoint(root)
    loaded, steps = deepspeed_job.full_state(dslaunch, fresh), fresh.global_steps
    theirs = _train(fresh, rank, world, range(3, 6))
    masters = {name: saved[name] for name, _ in engine.module.named_parameters()}
    return {"path": path, "same_state": loaded == saved, "losses": (ours, theirs), "steps": steps, "fp32": masters}


@pytest.mark.timeout(120)
def test_deepspeed_format_saves_in_the_background_and_keeps_the_last_tags(tmp_path: Path) -> None:
    results = run_world(_save_async_rotate_load, 2, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step2", "global_step3", "latest"]
    assert (tmp_path / "latest").read_text() == "global_step3"
    tag = tmp_path / "global_step3"
    manifest = json.loads((tag / "manifest.json").read_text())["body"]
    assert manifest["meta"]["format"] == "deepspeed" and manifest["meta"]["global_steps"] == 3
    assert sorted(manifest["files"]) == sorted(f.name for f in tag.glob("*.pt")) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    for r in results:  # the loaded tag is the save's state bit for bit, and continues alike
        assert r["path"] == str(tag / "mp_rank_00_model_states.pt") and r["same_state"] and r["steps"] == 3
        assert r["losses"][0] == r["losses"][1]
    # dslaunch's own zero-to-fp32 reads the format too (the newest tag: latest)
    from dslaunch.runtime.checkpoint.export import get_fp32_state_dict_from_zero_checkpoint

    exported = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert {name: t.reshape(-1).tolist() for name, t in exported.items()} == results[0]["fp32"]


def _stalled_second_save(root: str, port: int) -> None:
    """One rank: a complete DeepSpeed-format save of step 1, then a save of step 2 that stops for
    good with its files written, just before it would be published."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    from dslaunch.runtime.checkpoint.publish import LeaderSave

    engine = _engine(1, {"format": "deepspeed"})
    _train(engine, 0, 1, range(1))
    engine.save_checkpoint(root)
    _train(engine, 0, 1, range(1, 2))
    LeaderSave.install = lambda *args, **kwargs: time.sleep(3600)  # type: ignore[method-assign]
    engine.save_checkpoint(root)


def _load_latest(rank: int, world: int, root: str) -> tuple[str | None, int]:
    engine = _engine(world, {"format": "deepspeed"})
    path, _ = engine.load_checkpoint(root)
    return path, engine.global_steps


@pytest.mark.timeout(120)
def test_a_deepspeed_format_save_killed_before_publishing_leaves_the_previous_tag(tmp_path: Path) -> None:
    proc = _CTX.Process(target=_stalled_second_save, args=(str(tmp_path), free_port()), daemon=True)
    proc.start()
    pending = tmp_path / ".tmp-global_step2"
    deadline = time.monotonic() + 90
    while not (pending.is_dir() and any(pending.glob("*optim_states.pt"))) and time.monotonic() < deadline:
        assert proc.is_alive(), "the job exited early"
        time.sleep(0.05)
    time.sleep(0.5)  # its files are written; it stalls before publishing
    proc.kill()
    proc.join()
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert not (tmp_path / "global_step2").exists()
    assert deepspeed_tag(tmp_path) == tmp_path / "global_step1"
    assert run_world(_load_latest, 1, str(tmp_path)) == [(str(tmp_path / "global_step1" / "mp_rank_00_model_states.pt"), 1)]


def _stage0_size_one_bias(rank: int, world: int, root: str) -> tuple[list[float], list[float]]:
    import dslaunch

    def engine():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))  # a bias of one element
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
                  "zero_optimization": {"stage": 0}, "checkpoint": {"format": "deepspeed"}}
        return dslaunch.initialize(model=net, model_parameters=net.parameters(), config=config)[0]

    def train(e, steps: range) -> list[float]:
        out = []
        for step in steps:
            loss = e(torch.randn(2, 4, generator=torch.Generator().manual_seed(step))).pow(2).mean()
            e.backward(loss)
            e.step()
            out.append(loss.item())
        return out

    first = engine()
    train(first, range(2))
    first.save_checkpoint(root, tag="t")
    fresh = engine()
    fresh.load_checkpoint(root, tag="t")
    return train(first, range(2, 5)), train(fresh, range(2, 5))


@pytest.mark.timeout(60)
def test_a_stage0_tag_whose_model_has_a_one_element_parameter_resumes_exactly(tmp_path: Path) -> None:
    """Adam's 0-dim ``step`` and a one-element bias's moments have the same numel: the reader tells
    them apart by shape (it took the bias's ``step`` for a moment and refused the tag)."""
    ours, resumed = run_world(_stage0_size_one_bias, 1, str(tmp_path))[0]
    assert resumed == ours
