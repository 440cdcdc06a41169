"""DeepSpeed's progressive layer drop: the keep-probability schedule, the engine handing it to
training forwards and moving it at each optimizer step, the pipeline refusal and bad blocks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dslaunch.errors import ConfigError
from tests.distributed import run_world

GAMMA = 0.001


def _theta(theta: float, step: int) -> float:
    return (1.0 - theta) * np.exp(-GAMMA * step) + theta  # DeepSpeed's formula, in numpy as its test


@pytest.mark.parametrize("theta", [0.0, 0.1, 0.9, 1.0])
def test_the_schedule_falls_from_one_towards_theta(theta: float) -> None:
    from dslaunch.runtime.progressive_layer_drop import ProgressiveLayerDrop

    pld = ProgressiveLayerDrop(theta, GAMMA)
    assert pld.get_theta() == 1.0 and pld.get_state() == {"progressive_layer_drop": True, "pld_theta": 1.0}
    for step in range(10):
        pld.update_state(step)
        assert pld.get_theta() == _theta(theta, step)


class _Dropper(torch.nn.Module):
    """Records what each forward was handed; scales its output by the keep probability."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)
        self.handed: list[dict] = []

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        self.handed.append(dict(kwargs))
        return (self.lin(x) * kwargs.get("pld_theta", 1.0)).square().mean()


def _config(model_kwargs: bool = True) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": GAMMA}}


def _train(rank: int, world: int) -> dict:
    import dslaunch

    model = _Dropper()
    engine, *_ = dslaunch.initialize(model=model, config=_config())
    out: dict = {"getters": (engine.pld_enabled(), engine.pld_params(), engine.pld_theta(), engine.pld_gamma()),
                 "after": []}
    for _ in range(3):
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 4)))
            engine.step()
        out["after"].append(engine.get_pld_theta())
    engine.eval()
    engine(torch.zeros(2, 4))
    out["handed"] = model.handed

    class Plain(torch.nn.Linear):
        def forward(self, x):  # takes no keyword arguments
            return super().forward(x).sum()

    plain, *_ = dslaunch.initialize(model=Plain(4, 1), config=_config())
    try:
        plain(torch.zeros(2, 4))
    except TypeError as err:
        out["plain"] = str(err)
    return out


@pytest.mark.timeout(90)
def test_the_engine_hands_training_forwards_the_keep_probability() -> None:
    (r,) = run_world(_train, 1, timeout=80)
    assert r["getters"] == (True, {"theta": 0.5, "gamma": GAMMA}, 0.5, GAMMA)
    # moved before each step is counted: after step n (global_steps n + 1) it is step n's
    assert r["after"] == [_theta(0.5, 0), _theta(0.5, 1), _theta(0.5, 2)]
    thetas = [h["pld_theta"] for h in r["handed"][:6]]
    assert thetas == [1.0, 1.0, _theta(0.5, 0), _theta(0.5, 0), _theta(0.5, 1), _theta(0.5, 1)]
    assert all(h["progressive_layer_drop"] is True for h in r["handed"][:6])
    assert r["handed"][6] == {}  # an evaluation forward gets nothing
    assert math.isclose(_theta(0.5, 10**6), 0.5)
    assert "progressive_layer_drop" in r["plain"]  # a model without the keywords fails as under DeepSpeed


def _pipeline(rank: int, world: int) -> str:
    import dslaunch
    from dslaunch.pipe import PipelineModule
    from tests.runtime.pipe.helpers import layers, loss_fn

    dslaunch.init_distributed()
    try:
        dslaunch.initialize(model=PipelineModule(layers(), num_stages=2, loss_fn=loss_fn), config=_config())
    except ConfigError as err:
        return str(err)
    return "built"


@pytest.mark.timeout(90)
def test_a_pipeline_refuses_it_in_one_line() -> None:
    for said in run_world(_pipeline, 2, timeout=80):
        assert said.startswith("'progressive_layer_drop.enabled': not with a PipelineModule")


@pytest.mark.parametrize(("block", "key"), [({"enabled": True, "theta": 1.5}, "progressive_layer_drop.theta"),
                                            ({"enabled": True, "gama": 0.1}, "progressive_layer_drop.gama")])
def test_a_bad_block_is_one_line_naming_its_key(block: dict, key: str) -> None:
    from dslaunch.runtime.config import load_config

    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config({"train_batch_size": 2, "progressive_layer_drop": block}, 1)
