"""``deepspeed.utils.bwc``: an mpu's axes under each generation of names, DeepSpeed's order."""

from __future__ import annotations

import pytest


class _Megatron:
    def get_tensor_model_parallel_rank(self) -> int:
        return 3

    def get_tensor_model_parallel_world_size(self) -> int:
        return 4

    def get_tensor_model_parallel_group(self) -> str:
        return "tp"

    def get_model_parallel_rank(self) -> int:  # older name, shadowed by the newer one
        return -1

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 2

    def get_pipeline_model_parallel_group(self) -> str:
        return "pp"


class _Old:
    def get_model_parallel_rank(self) -> int:
        return 1

    def get_model_parallel_world_size(self) -> int:
        return 2

    def get_model_parallel_group(self) -> str:
        return "mp"


@pytest.mark.timeout(30)
def test_each_generation_of_names() -> None:
    from dslaunch.runtime import utils
    from dslaunch.utils import bwc

    assert utils.bwc_tensor_model_parallel_rank is bwc.bwc_tensor_model_parallel_rank
    m, old = _Megatron(), _Old()
    assert [bwc.bwc_tensor_model_parallel_rank(m), bwc.bwc_tensor_model_parallel_world_size(m),
            bwc.bwc_tensor_model_parallel_group(m)] == [3, 4, "tp"]
    assert [bwc.bwc_tensor_model_parallel_rank(old), bwc.bwc_tensor_model_parallel_world_size(old),
            bwc.bwc_tensor_model_parallel_group(old)] == [1, 2, "mp"]
    assert (bwc.bwc_pipeline_parallel_world_size(m), bwc.bwc_pipeline_parallel_group(m)) == (2, "pp")
    assert bwc.bwc_pipeline_parallel_world_size(old) == 1  # no pipeline names: one stage
    with pytest.raises(AttributeError, match="answers no pipeline group"):
        bwc.bwc_pipeline_parallel_group(old)
    assert (bwc.bwc_tensor_model_parallel_rank(), bwc.bwc_tensor_model_parallel_world_size(),
            bwc.bwc_tensor_model_parallel_group(), bwc.bwc_pipeline_parallel_group()) == (0, 1, None, None)
