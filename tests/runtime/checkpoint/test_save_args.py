"""Bad ``save_checkpoint`` arguments are one clear error on every rank, never a hang: the ranks
agree on them in one all-gather before anything is written (``save_dir=""`` used to hang every
rank). The types are DeepSpeed's: ``ValueError`` for a bad save_dir, ``AssertionError`` for tags
that differ under ``tag_validation: Fail`` (its tests expect them)."""

from __future__ import annotations

import os

import pytest

from dslaunch.errors import CheckpointArgumentError, CheckpointError, TagMismatchError
from tests.distributed import run_world


def _engine(tag_validation: str = "Warn"):
    import torch

    import dslaunch

    model = torch.nn.Linear(4, 4)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "checkpoint": {"tag_validation": tag_validation}}
    engine, *_ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _save_each(rank: int, world: int, root: str) -> list[tuple[str, str, bool, bool]]:
    afile = os.path.join(root, "a-file")
    if rank == 0:
        with open(afile, "w") as f:
            f.write("x")
    engine = _engine()
    engine.global_rank  # noqa: B018 - initialised
    cases = [("empty", "", None), ("none", None, None), ("a file", afile, None),
             ("bad tag", root, "a/b"), ("latest", root, "latest"),
             ("one rank's tag", root, "good" if rank == 0 else "../escape")]
    seen = []
    for name, save_dir, tag in cases:
        with pytest.raises(CheckpointError) as err:
            engine.save_checkpoint(save_dir, tag=tag)
        seen.append((name, str(err.value), isinstance(err.value, ValueError),
                     isinstance(err.value, CheckpointArgumentError)))
    engine.save_checkpoint(root, tag="fine")  # the ranks are still in step
    return seen


@pytest.mark.timeout(120)
def test_bad_save_arguments_raise_on_every_rank_and_the_ranks_stay_in_step(tmp_path):
    per_rank = run_world(_save_each, 2, str(tmp_path), timeout=100)
    assert per_rank[0] == per_rank[1]  # the same error, word for word, on both ranks
    said = {name: (msg, is_value, is_arg) for name, msg, is_value, is_arg in per_rank[0]}
    assert all(is_value and is_arg for _, is_value, is_arg in said.values()), said
    assert said["empty"][0] == "save_checkpoint: save_dir is empty; give the directory to save into"
    assert said["none"][0] == "save_checkpoint: save_dir must be a directory path, got NoneType"
    assert said["a file"][0].endswith("a-file' is not a directory")
    assert said["bad tag"][0].startswith("save_checkpoint: invalid checkpoint tag 'a/b'")
    assert said["one rank's tag"][0].endswith("(on rank 1)") and "'../escape'" in said["one rank's tag"][0]
    assert os.path.isdir(tmp_path / "fine") and not os.path.exists(tmp_path / "a")


def _differing(rank: int, world: int, root: str) -> tuple[bool, bool]:
    engine = _engine("Fail")
    with pytest.raises(AssertionError) as err:
        engine.save_checkpoint(root, tag=f"tag-{rank}")
    return isinstance(err.value, TagMismatchError), "checkpoint tags differ" in str(err.value)


@pytest.mark.timeout(120)
def test_tags_that_differ_under_fail_are_an_assertion_error_as_deepspeed_s(tmp_path):
    assert run_world(_differing, 2, str(tmp_path), timeout=100) == [(True, True), (True, True)]
