"""``deepspeed.moe.utils``: the expert-parameter helpers, on dense models and on MoE models."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import UsageError
from dslaunch.moe import utils
from dslaunch.moe.layer import MoE
from dslaunch.runtime.moe import expert_group_name

pytestmark = pytest.mark.timeout(30)


def _dense() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


class _TwoMoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 4)
        self.moe1 = MoE(4, torch.nn.Linear(4, 4), num_experts=4, ep_size=2)
        self.moe2 = MoE(4, torch.nn.Linear(4, 4), num_experts=8, ep_size=4)


def test_param_groups_of_a_dense_model_come_back_as_given() -> None:
    model = _dense()
    group = {"params": filter(lambda p: p.requires_grad, model.parameters()), "name": "parameters", "lr": 0.1}
    groups = utils.split_params_into_different_moe_groups_for_optimizer(group)
    assert groups == [group] and groups[0]["params"] == list(model.parameters())  # a list now, not a filter
    torch.optim.SGD(groups, lr=0.1).step()  # usable by an optimizer as DeepSpeed's CIFAR example does
    pair = ({"params": [model[0].weight], "name": "a"}, {"params": [model[1].weight], "name": "b"})
    assert utils.split_params_into_different_moe_groups_for_optimizer(pair) == list(pair)
    with pytest.raises(ValueError, match="Unknown param group type"):
        utils.split_params_into_different_moe_groups_for_optimizer(model.parameters())
    assert utils.configure_moe_param_groups(list(model.parameters()))[0]["name"] == "dense-params"
    assert utils.has_moe_layers(model) == (False, 0)


def test_expert_marks_are_read_as_deepspeed_marks_them() -> None:
    model = _dense()
    assert not any(utils.is_moe_param(p) for p in model.parameters())
    model[1].weight.allreduce = False  # DeepSpeed's mark of an expert's parameter
    assert utils.is_moe_param(model[1].weight) and utils.is_moe_param_group({"moe": True})
    shared, expert = utils.split_params_into_shared_and_expert_params(model.parameters())
    assert expert == [model[1].weight] and len(shared) == 3
    model(torch.ones(1, 4)).sum().backward()
    shared_grads, expert_grads = utils.split_params_grads_into_shared_and_expert_params(model.parameters())
    assert len(shared_grads) == 3 and torch.equal(expert_grads[0], model[1].weight.grad)
    with pytest.raises(UsageError, match=r"has group_name None: set param.group_name = \"ep_size_<N>\""):
        utils.split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "name": "p"})


def test_expert_parameters_move_to_groups_of_their_own_as_deepspeed_moves_them() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    for p in [*model[1].parameters(), *model[2].parameters()]:
        p.allreduce, p.group_name = False, "ep_size_2"
    model[2].bias.group_name = "ep_size_4"
    dense = {"params": model.parameters(), "name": "p", "lr": 0.1}
    groups = utils.split_params_into_different_moe_groups_for_optimizer(dense, max_group_size=10)
    assert [(g["name"], g.get("moe", False), [tuple(p.shape) for p in g["params"]]) for g in groups] == [
        ("p", False, [(3, 4), (3,)]),
        ("ep_size_2", True, [(3, 3)]), ("ep_size_2", True, [(3,), (2, 3)]),  # chunks of <= 10 elements
        ("ep_size_4", True, [(2,)])]
    assert groups[0] is dense and all(g["lr"] == 0.1 for g in groups)
    assert expert_group_name(model[2].bias) == "ep_size_4" and expert_group_name(model[0].bias) is None


def test_expert_parameters_get_groups_of_their_own_per_expert_group() -> None:
    model = _TwoMoE()
    assert utils.has_moe_layers(model) == (True, 4)
    experts1 = list(model.moe1.deepspeed_moe.experts.parameters())
    experts2 = list(model.moe2.deepspeed_moe.experts.parameters())
    dense = [p for p in model.parameters() if not utils.is_moe_param(p)]
    groups = utils.split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "name": "all",
                                                                   "lr": 0.5})
    assert [(g["name"], g.get("moe", False), g["lr"]) for g in groups] == [
        ("all", False, 0.5), ("ep_size_2", True, 0.5), ("ep_size_4", True, 0.5)]
    assert groups[0]["params"] == dense and groups[1]["params"] == experts1 and groups[2]["params"] == experts2
    torch.optim.SGD(groups, lr=0.1).step()
    # max_group_size cuts an expert group into runs (a Linear(4, 4) expert: 16 + 4 elements)
    small = utils.split_params_into_different_moe_groups_for_optimizer({"params": list(model.moe1.parameters()),
                                                                  "name": "m"}, max_group_size=20)
    assert [len(g["params"]) for g in small if g.get("moe")] == [2, 2]
    assert [sum(p.numel() for p in g["params"]) for g in small if g.get("moe")] == [20, 20]
    with pytest.raises(ValueError, match=r"param group 0 holds expert parameters but has no 'name'"):
        utils.split_params_into_different_moe_groups_for_optimizer([{"params": experts1}])
    configured = utils.configure_moe_param_groups(list(model.parameters()))
    assert [g["name"] for g in configured] == ["dense-params", "ep_size_2", "ep_size_4"]
    assert utils.configure_moe_param_groups(configured) is configured  # already split: as given
