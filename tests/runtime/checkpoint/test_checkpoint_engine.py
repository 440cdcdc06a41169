"""``deepspeed.runtime.checkpoint_engine``: DeepSpeed's ``TorchCheckpointEngine`` saves a file whole or
not at all, through ``safe_write``, and loads it back; the interface keeps DeepSpeed's defaults."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dslaunch.runtime.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine, TorchCheckpointEngine


@pytest.mark.timeout(30)
def test_save_load_round_trip_and_deepspeeds_defaults(tmp_path: Path) -> None:
    engine = TorchCheckpointEngine()
    info = CheckpointCommitInfo(tag="global_step1", save_dir=str(tmp_path), save_latest=True)
    engine.create(info)
    engine.makedirs(tmp_path / "global_step1", exist_ok=True)
    state = {"w": torch.arange(6.0).view(2, 3), "step": 3, "note": "x"}
    engine.save(state, str(tmp_path / "global_step1" / "model.pt"))
    loaded = engine.load(str(tmp_path / "global_step1" / "model.pt"), map_location="cpu")
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3 and loaded["note"] == "x"
    assert engine.commit(info) is True and engine.name == "TorchCheckpointEngine"
    assert engine.is_data_parallel_writer(0) and not engine.is_data_parallel_writer(1)
    assert not engine.is_decoupled() and engine.preserves_storage_sharing() and engine.get_commit_info() is None
    with pytest.raises(FileExistsError):
        engine.makedirs(tmp_path / "global_step1")
    with pytest.raises(TypeError):
        CheckpointEngine()  # abstract, as DeepSpeed's


@pytest.mark.timeout(30)
def test_a_failed_save_leaves_the_old_file_and_no_debris(tmp_path: Path) -> None:
    engine, path = TorchCheckpointEngine(), tmp_path / "state.pt"
    engine.save({"v": 1}, str(path))

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        engine.save({"v": 2, "bad": Unpicklable()}, str(path))
    assert engine.load(str(path)) == {"v": 1} and os.listdir(tmp_path) == ["state.pt"]


@pytest.mark.timeout(30)
def test_it_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep")
    (tmp_path / "out").mkdir()
    os.symlink(target, tmp_path / "out" / "model.pt")
    TorchCheckpointEngine().save({"v": 1}, str(tmp_path / "out" / "model.pt"))
    assert target.read_text() == "keep" and not (tmp_path / "out" / "model.pt").is_symlink()
