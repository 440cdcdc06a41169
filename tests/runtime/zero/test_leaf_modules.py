"""ZeRO-3 leaf modules: DeepSpeed's flagging functions (by class, name, suffix), the
``zero_optimization.leaf_module`` section, and what a flagged module does at stage 3 on gloo
ranks (its whole subtree gathered on entry, training as plain torch)."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import ConfigError
from dslaunch.runtime.zero.config import DeepSpeedZeroConfig
from dslaunch.runtime.zero.leaf_module_config import (
    DEFAULT_LEAF_MODULE_CLASSES,
    DeepSpeedZeroLeafModuleConfig,
)
from dslaunch.utils import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    z3_leaf_module,
)
from tests.distributed import run_world

D = 6


class Pick(torch.nn.Module):
    """Runs one of its two children per call, chosen by the input: ranks may pick different ones."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(D, D), torch.nn.Linear(D, D)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[int(x.sum().item() > 0)](x)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(D, D)
        self.pick = Pick()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.pick(torch.tanh(self.inp(x))), y)


def test_flag_by_name_and_suffix_return_matches_and_misses() -> None:
    net = Net()
    assert set_z3_leaf_modules_by_name(net, ["pick"]) == ([net.pick], [])
    assert z3_leaf_module(net.pick) and not z3_leaf_module(net)
    found, missing = set_z3_leaf_modules_by_suffix(net, ["experts.0", "experts.1", "nothing"],
                                                   raise_if_not_found=False)
    assert found == list(net.pick.experts) and missing == ["nothing"]
    with pytest.raises(ValueError, match="nothing"):
        set_z3_leaf_modules_by_name(net, ["nothing"])
    with pytest.raises(ValueError, match="suffixes"):
        set_z3_leaf_modules_by_suffix(net, ["nothing"])
    assert set_z3_leaf_modules_by_name(net, ["pick"], flag=False) == ([net.pick], [])
    assert not z3_leaf_module(net.pick)
    # a class by its qualified name, a base class by type
    assert set_z3_leaf_modules(net, [f"{Pick.__module__}.{Pick.__qualname__}"]) == [net.pick]
    assert set_z3_leaf_modules(Net(), [torch.nn.ModuleList], raise_if_not_found=False)
    assert set_z3_leaf_modules(net, ["Nothing"], raise_if_not_found=False) == []


def test_leaf_module_section_defaults_coercion_and_errors() -> None:
    section = DeepSpeedZeroConfig().leaf_module
    assert section.classes == DEFAULT_LEAF_MODULE_CLASSES and section.names == [] == section.name_suffixes
    assert "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock" in DEFAULT_LEAF_MODULE_CLASSES
    given = DeepSpeedZeroConfig(leaf_module={"classes": "my.Block", "names": ["a", "a"], "name_suffixes": "tail"})
    assert (given.leaf_module.classes, given.leaf_module.names, given.leaf_module.name_suffixes) == (
        ["my.Block"], ["a"], ["tail"])
    assert isinstance(given.leaf_module, DeepSpeedZeroLeafModuleConfig)
    assert DeepSpeedZeroLeafModuleConfig(names="x").names == ["x"]
    with pytest.raises(ConfigError, match=r"zero_optimization\.leaf_module\.classes.*list of names"):
        DeepSpeedZeroConfig(leaf_module={"classes": [3]})
    with pytest.raises(ConfigError, match="did you mean 'name_suffixes'"):
        DeepSpeedZeroConfig(leaf_module={"name_sufixes": ["x"]})


def _train(rank: int, world: int) -> tuple[list[float], list[float], list[bool], list[str]]:
    import dslaunch
    from dslaunch.runtime.zero.partition_parameters import ZeroParamStatus

    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_clipping": 0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "leaf_module": {"classes": ["Pick"], "names": ["nothing"]}}}
    engine, *_ = dslaunch.initialize(model=net, config=cfg)
    whole: list[bool] = []
    # after the engine's own pre-hook: what entering the leaf gathered
    net.pick.register_forward_pre_hook(lambda m, a: whole.append(all(
        p.ds_status is ZeroParamStatus.AVAILABLE for p in m.parameters())))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2 * world, D, generator=g), torch.randn(2 * world, D, generator=g)) for _ in range(4)]
    for x, y in data:
        loss = engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        ref_loss = sum(ref(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2]) for r in range(world)) / world
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        final = [engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]).item() for x, y in data]
        expected = [ref(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]).item() for x, y in data]
    names = {id(m): n for n, m in net.named_modules()}
    return final, expected, whole, [names[id(m)] for m in get_z3_leaf_modules(net)]


@pytest.mark.timeout(90)
def test_config_leaf_module_gathers_the_subtree_and_trains_like_torch() -> None:
    """``leaf_module.classes`` flags the block when the engine is built; entering it gathers both
    children (one runs per call, chosen by the rank's input), and training matches plain torch."""
    for final, expected, whole, flagged in run_world(_train, 2):
        assert flagged == ["pick"]
        assert whole and all(whole)
        assert final == pytest.approx(expected, rel=1e-5, abs=1e-6)
