"""DeepSpeed's file names and telling its tag folders from dslaunch's (no DeepSpeed needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.deepspeed_layout import (
    ckpt_name,
    deepspeed_tag,
    model_states_name,
    optim_states_name,
    zero_ckpt_name,
)
from dslaunch.runtime.checkpoint.deepspeed_read import read_deepspeed


def test_names_are_deepspeeds() -> None:
    assert model_states_name() == "mp_rank_00_model_states.pt"
    assert model_states_name(3) == "zero_pp_rank_3_mp_rank_00_model_states.pt"
    assert optim_states_name(1) == "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert optim_states_name(0, bf16=True) == "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert ckpt_name("d", "t", partitioned=False) == "d/t/mp_rank_00_model_states.pt"
    assert ckpt_name("d", 5, partitioned=True, dp_rank=2) == "d/5/zero_pp_rank_2_mp_rank_00_model_states.pt"
    assert zero_ckpt_name("d", "t", 1, bf16=True) == "d/t/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"


def test_a_deepspeed_tag_is_found_by_latest_or_name(tmp_path: Path) -> None:
    assert deepspeed_tag(tmp_path) is None  # no latest
    (tmp_path / "global_step3").mkdir()
    (tmp_path / "global_step3" / model_states_name()).write_bytes(b"")
    (tmp_path / "latest").write_text("global_step3\n")
    assert deepspeed_tag(tmp_path) == tmp_path / "global_step3"
    assert deepspeed_tag(tmp_path, "global_step3") == tmp_path / "global_step3"
    assert deepspeed_tag(tmp_path, "nope") is None
    (tmp_path / "global_step3" / "manifest.json").write_text("{}")  # dslaunch's own
    assert deepspeed_tag(tmp_path) is None


def test_model_parallel_deepspeed_checkpoints_are_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / model_states_name()).write_bytes(b"")
    (tmp_path / model_states_name(mp_rank=1)).write_bytes(b"")
    with pytest.raises(CheckpointError, match="tensor-parallel .* cannot be loaded yet") as info:
        read_deepspeed(tmp_path)
    assert "\n" not in str(info.value)


def test_tensor_parallel_pipelines_are_refused_in_one_line(tmp_path: Path) -> None:
    torch.save({"module": None, "dp_world_size": 1, "mp_world_size": 4,
                "checkpoint_parallel_dimensions": {"pp_degree": 2, "tp_degree": 2}}, tmp_path / model_states_name())
    torch.save({"weight": torch.zeros(2)}, tmp_path / "layer_00-model_00-model_states.pt")
    with pytest.raises(CheckpointError, match="tp_degree 2") as info:
        read_deepspeed(tmp_path)
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)
