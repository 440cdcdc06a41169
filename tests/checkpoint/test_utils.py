"""``clone_tensors_for_torch_save``: each tensor saved with only its own data; DeepSpeed's file names."""

from __future__ import annotations

import io

import torch

from dslaunch.checkpoint.utils import clone_tensors_for_torch_save, get_model_ckpt_name_for_rank


def test_views_of_a_flat_buffer_are_saved_alone() -> None:
    flat = torch.zeros(1 << 20)  # 4 MiB, like a ZeRO flat buffer
    state = {"a": flat[:4], "nested": [flat[4:8], (flat[8:10], "keep")], "n": 3}
    cloned = clone_tensors_for_torch_save(state)
    assert cloned["n"] == 3 and cloned["nested"][1][1] == "keep" and isinstance(cloned["nested"][1], tuple)
    assert torch.equal(cloned["a"], flat[:4]) and cloned["a"].untyped_storage().nbytes() == 16

    def saved_bytes(obj: object) -> int:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.tell()

    assert saved_bytes(state) > 4 << 20 > 100 * saved_bytes(cloned)
    flat[0] = 1.0
    assert cloned["a"][0] == 0.0  # a copy, not a view


def test_deepspeeds_model_states_file_name(tmp_path) -> None:
    tag = tmp_path / "global_step0"
    assert get_model_ckpt_name_for_rank(tag, "00") == str(tag / "mp_rank_00_model_states.pt")
    assert get_model_ckpt_name_for_rank("ckpt/step5", "01").endswith("step5/mp_rank_01_model_states.pt")
