"""MoE checkpoints and tensor slices (``deepspeed.moe.layer.MoE`` beside a Megatron-style mpu,
tensor 2 x data 2 on gloo, world 4): a resume at the saving layout, never a wrong load elsewhere.

- Saved at tensor 2 x data 2 (experts over every rank, or tensor-sliced experts over each lane's
  data ranks; ZeRO 0 and 2) after 2 steps, the tag resumes at that layout and the next 3 losses
  equal those of the run that never stopped, bit for bit.
- Loaded at another layout (tensor 1 x data 2, data 4 without an mpu, tensor 2 x data 2 at
  another expert-parallel size or with the experts tensor-sliced) it is refused in one line naming
  both layouts, and ``zero_to_fp32`` refuses it (the parts share parameter names). So is a
  data-parallel MoE tag (world 2, ep 2) in the tensor 2 x data 2 engine, with
  ``load_module_strict=False`` too: each rank's local expert names stand for other global experts
  there, and taken by name the ranks of the second lane got the first lane's experts (expert 0's
  weights where expert 2 belongs), before this was refused.
- DeepSpeed's format (``checkpoint.format: deepspeed``) refuses the save in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.moe.models import MoECase, TinyMoENet, batch
from tests.runtime.moe.test_tensor_parallel import MegatronMPU

CASE, TENSOR, BEFORE, AFTER = MoECase(1, False, False), 2, 2, 3


def _engine(rank: int, ep_size: int, tensor: int, sliced: bool = False, stage: int = 2, fmt: str = "dslaunch"):  # noqa: ANN202
    import dslaunch as deepspeed
    from dslaunch.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(verbose=False)
    mpu = MegatronMPU(tensor) if tensor > 1 else None
    model = TinyMoENet(CASE, ep_size)
    model.moe.enable_expert_tensor_parallelism = sliced
    expert_rank = (rank // tensor) % ep_size if sliced else rank % ep_size  # DeepSpeed's two layouts
    model.set_expert_weights(expert_rank * model.moe.num_local_experts)
    params = split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "name": "p"})
    config = {"train_micro_batch_size_per_gpu": 16, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": stage},
              "checkpoint": {"format": fmt}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config, mpu=mpu)
    return engine, model


def _steps(engine, rank: int, tensor: int, first: int, count: int) -> list[float]:  # noqa: ANN001
    losses = []
    for step in range(first, first + count):
        loss = engine(*batch(rank // tensor, step))  # the tensor slices of a replica see the same tokens
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _attempt(call: Callable[[], object], model: torch.nn.Module) -> dict:
    """``call()``'s CheckpointError (None if it succeeded) and every global expert's weights this rank
    holds after it."""
    from dslaunch.errors import CheckpointError
    from dslaunch.runtime.checkpoint.experts import expert_names

    try:
        call()
        err = None
    except CheckpointError as exc:
        err = str(exc)
    rename = expert_names(model)
    return {"error": err, "experts": {rename[n]: p.detach().numpy().copy() for n, p in model.named_parameters()
                                      if n in rename}}


def _save(rank: int, world: int, ep_size: int, tensor: int, sliced: bool, stage: int, save_dir: str,
          fmt: str = "dslaunch") -> dict:
    """``BEFORE`` steps, a save, ``AFTER`` more (the run that never stopped)."""
    from dslaunch.utils import groups

    engine, model = _engine(rank, ep_size, tensor, sliced, stage, fmt)
    _steps(engine, rank, tensor, 0, BEFORE)
    out = _attempt(lambda: engine.save_checkpoint(save_dir, tag="saved"), model)
    out["unbroken"] = _steps(engine, rank, tensor, BEFORE, AFTER) if out["error"] is None else []
    groups.mpu = groups.grid = None
    return out


def _load(rank: int, world: int, ep_size: int, tensor: int, sliced: bool, stage: int, load_dir: str,
          strict: bool = True) -> dict:
    """A load, then ``AFTER`` steps if it loaded."""
    from dslaunch.utils import groups

    engine, model = _engine(rank, ep_size, tensor, sliced, stage)
    out = _attempt(lambda: engine.load_checkpoint(load_dir, tag="saved", load_module_strict=strict), model)
    out["resumed"] = _steps(engine, rank, tensor, BEFORE, AFTER) if out["error"] is None else []
    groups.mpu = groups.grid = None
    return out


def _refused(results: list[dict], *named: str) -> None:
    for rank, result in enumerate(results):
        err = result["error"]
        assert err is not None, f"rank {rank} loaded"
        assert "\n" not in err and "expert parameters (ep_size_" in err and all(n in err for n in named), err


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("sliced", "stage"), [(False, 2), (True, 2), (False, 0)],
                         ids=["experts-over-every-rank", "tensor-sliced-experts", "zero0"])
def test_an_moe_tag_beside_tensor_slices_resumes_at_its_layout_only(tmp_path: Path, sliced: bool, stage: int) -> None:
    saved = run_world(_save, 4, 2, TENSOR, sliced, stage, str(tmp_path), timeout=150)
    assert all(s["error"] is None for s in saved), saved[0]["error"]
    resumed = run_world(_load, 4, 2, TENSOR, sliced, stage, str(tmp_path), timeout=150)
    for rank, (a, b) in enumerate(zip(saved, resumed, strict=True)):
        assert b["error"] is None, b["error"]
        assert a["unbroken"] == b["resumed"], (rank, a["unbroken"], b["resumed"])
    assert saved[0]["unbroken"][0] != saved[0]["unbroken"][-1]  # it trains
    if sliced or stage:
        return
    # elsewhere: tensor 1 x data 2, data 4 (no mpu), another expert-parallel size beside the mpu
    _refused(run_world(_load, 2, 2, 1, False, stage, str(tmp_path), timeout=120), "data=2, model=2",
             "no model parallelism")
    _refused(run_world(_load, 4, 2, 1, False, stage, str(tmp_path), timeout=120), "data=2, model=2")
    _refused(run_world(_load, 4, 4, TENSOR, False, stage, str(tmp_path), timeout=120), "(ep_size_4)",
             "another expert layout")
    _refused(run_world(_load, 4, 2, TENSOR, True, stage, str(tmp_path), timeout=120), "another expert layout")
    from dslaunch.errors import CheckpointError
    from dslaunch.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises(CheckpointError, match="no single state dict"):  # the parts share names
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="saved")


@pytest.mark.timeout(150)
def test_deepspeeds_format_refuses_experts_beside_tensor_slices(tmp_path: Path) -> None:
    got = run_world(_save, 4, 2, TENSOR, False, 2, str(tmp_path), "deepspeed", timeout=120)
    for result in got:
        assert result["error"] is not None and "\n" not in result["error"] and "an mpu" in result["error"]
    assert not (tmp_path / "saved").exists() and not (tmp_path / "latest").exists()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "module-weights-only"])
def test_a_data_parallel_moe_tag_is_refused_beside_tensor_slices(tmp_path: Path, strict: bool) -> None:
    saved = run_world(_save, 2, 2, 1, False, 2, str(tmp_path), timeout=60)
    assert all(s["error"] is None for s in saved)
    experts = {name: value for s in saved for name, value in s["experts"].items()}
    got = run_world(_load, 4, 2, TENSOR, False, 2, str(tmp_path), strict, timeout=120)
    for rank, result in enumerate(got):
        if result["error"] is None:  # it loaded: then every global expert must be the one saved under its number
            wrong = [n for n, v in result["experts"].items() if not (v == experts[n]).all()]
            assert not wrong, f"rank {rank} loaded other experts' weights into {wrong[:2]}"
    _refused(got, "no model parallelism", "data=2, model=2")
