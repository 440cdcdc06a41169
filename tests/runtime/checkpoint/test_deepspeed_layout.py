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


def test_zero_to_fp32_lists_a_tags_files_by_rank(tmp_path: Path) -> None:
    from dslaunch.utils.zero_to_fp32 import get_model_state_files, get_optim_files

    with pytest.raises(FileNotFoundError, match=r"can't find \*_optim_states.pt files in directory"):
        get_optim_files(tmp_path)
    for rank in (10, 2, 0, 1):
        (tmp_path / optim_states_name(rank)).write_bytes(b"")
        (tmp_path / model_states_name(rank)).write_bytes(b"")
    want = [str(tmp_path / optim_states_name(rank)) for rank in (0, 1, 2, 10)]  # 10 after 2, as numbers
    assert get_optim_files(tmp_path) == want
    assert get_model_state_files(str(tmp_path)) == [str(tmp_path / model_states_name(r)) for r in (0, 1, 2, 10)]


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


def test_broken_tensor_parallel_files_are_named_in_one_line(tmp_path: Path) -> None:
    (tmp_path / model_states_name()).write_bytes(b"")
    (tmp_path / model_states_name(mp_rank=1)).write_bytes(b"")
    with pytest.raises(CheckpointError, match="unreadable or truncated") as info:
        read_deepspeed(tmp_path)
    assert str(tmp_path / model_states_name()) in str(info.value) and "\n" not in str(info.value)


def test_tensor_parallel_pipelines_are_refused_in_one_line(tmp_path: Path) -> None:
    torch.save({"module": None, "dp_world_size": 1, "mp_world_size": 4,
                "checkpoint_parallel_dimensions": {"pp_degree": 2, "tp_degree": 2}}, tmp_path / model_states_name())
    torch.save({"weight": torch.zeros(2)}, tmp_path / "layer_00-model_00-model_states.pt")
    with pytest.raises(CheckpointError, match="tp_degree 2") as info:
        read_deepspeed(tmp_path)
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


def _autotp_tag(folder: Path, whole: dict[str, torch.Tensor], slice_map: bool = True, degree: int = 2) -> None:
    """A ZeRO-1 AutoTP tag of 2 tensor ranks as DeepSpeed 0.19 lays it out: ``a.weight`` cut by
    rows, ``b.weight`` by columns, ``c.bias`` whole on both; moments 2x and 3x the weights."""
    from collections import OrderedDict

    from dslaunch.runtime.checkpoint.deepspeed_pickle import to_bytes
    from dslaunch.runtime.checkpoint.deepspeed_write import _zero12_file

    cuts = {"a.weight": 0, "b.weight": 1}
    params = {f"^{n}$".replace(".", "\\."): {"logical_shape": list(whole[n].shape), "ranks": {
        t: {"shard_shape": list(whole[n].chunk(2, d)[t].shape), "pieces": [{
            "shape": list(whole[n].chunk(2, d)[t].shape),
            "source": [t * whole[n].chunk(2, d)[0].shape[d] * whole[n].stride(d), list(whole[n].stride())],
            "dest": [0, list(whole[n].chunk(2, d)[t].contiguous().stride())], "locations": [t]}]}
        for t in range(2)}} for n, d in cuts.items()}
    for t in range(2):
        mine = OrderedDict((n, whole[n].chunk(2, cuts[n])[t].contiguous() if n in cuts else whole[n]) for n in whole)
        flat = torch.cat([v.reshape(-1) for v in mine.values()])
        group = {"names": list(mine), "shapes": [tuple(v.shape) for v in mine.values()], "numel": flat.numel(),
                 "master": flat, "optim_state": {"exp_avg": 2 * flat, "exp_avg_sq": 3 * flat},
                 "optim_scalars": {"step": 3}, "hparams": {"lr": 0.1}}
        states = {"module": dict(mine), "dp_world_size": 1, "mp_world_size": 2,
                  "param_shapes": [OrderedDict((n, v.shape) for n, v in mine.items())],
                  "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": degree}}
        if slice_map:
            states["universal_checkpoint_info"] = {"affine_map": {"version": 1, "params": params}}
        (folder / model_states_name(None, t)).write_bytes(to_bytes(states))
        (folder / optim_states_name(0, False, t)).write_bytes(
            to_bytes({"optimizer_state_dict": _zero12_file([group], [(1, 0)], 1, 0.0)}))


def test_autotp_slices_are_joined_by_deepspeeds_slice_map(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    whole = {"a.weight": torch.randn(4, 3, generator=g), "b.weight": torch.randn(3, 4, generator=g),
             "c.bias": torch.randn(3, generator=g)}
    _autotp_tag(tmp_path, whole)
    state = read_deepspeed(tmp_path)
    for name, w in whole.items():
        assert torch.equal(state.fp32[name], w) and torch.equal(state.module[name], w), name
        assert torch.equal(state.optim[name]["exp_avg"], 2 * w) and torch.equal(state.optim[name]["exp_avg_sq"], 3 * w)
    _autotp_tag(tmp_path, whole, degree=3)  # the model states say 3 tensor ranks, the tag has 2
    with pytest.raises(CheckpointError, match="tensor-parallel degree 3 .*mp_rank_02_model_states.pt"):
        read_deepspeed(tmp_path)
    _autotp_tag(tmp_path, whole, slice_map=False)
    with pytest.raises(CheckpointError, match="slice map") as info:
        read_deepspeed(tmp_path)
    assert str(tmp_path / model_states_name()) in str(info.value) and "\n" not in str(info.value)
