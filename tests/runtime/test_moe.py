"""``deepspeed.moe``: the parameter helpers (dense answers without experts, expert groups split off as
DeepSpeed splits them), MoE refused on use."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import UsageError
from dslaunch.runtime import moe

pytestmark = pytest.mark.timeout(30)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_param_groups_of_a_dense_model_come_back_as_given() -> None:
    model = _model()
    group = {"params": filter(lambda p: p.requires_grad, model.parameters()), "name": "parameters", "lr": 0.1}
    groups = moe.split_params_into_different_moe_groups_for_optimizer(group)
    assert groups == [group] and groups[0]["params"] == list(model.parameters())  # a list now, not a filter
    torch.optim.SGD(groups, lr=0.1).step()  # usable by an optimizer as DeepSpeed's CIFAR example does
    pair = ({"params": [model[0].weight], "name": "a"}, {"params": [model[1].weight], "name": "b"})
    assert moe.split_params_into_different_moe_groups_for_optimizer(pair) == list(pair)
    with pytest.raises(ValueError, match="Unknown param group type"):
        moe.split_params_into_different_moe_groups_for_optimizer(model.parameters())
    assert moe.configure_moe_param_groups(list(model.parameters()))[0]["name"] == "dense-params"


def test_expert_marks_are_read_as_deepspeed_marks_them() -> None:
    model = _model()
    assert moe.has_moe_layers(model) == (False, 0)
    assert not any(moe.is_moe_param(p) for p in model.parameters())
    model[1].weight.allreduce = False  # DeepSpeed's mark of an expert's parameter
    assert moe.is_moe_param(model[1].weight) and moe.is_moe_param_group({"moe": True})
    shared, expert = moe.split_params_into_shared_and_expert_params(model.parameters())
    assert expert == [model[1].weight] and len(shared) == 3
    model(torch.ones(1, 4)).sum().backward()
    shared_grads, expert_grads = moe.split_params_grads_into_shared_and_expert_params(model.parameters())
    assert len(shared_grads) == 3 and torch.equal(expert_grads[0], model[1].weight.grad)
    with pytest.raises(UsageError, match=r"has group_name None: set param.group_name = \"ep_size_<N>\""):
        moe.split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "name": "p"})


def test_expert_parameters_move_to_groups_of_their_own_as_deepspeed_moves_them() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    for p in [*model[1].parameters(), *model[2].parameters()]:
        p.allreduce, p.group_name = False, "ep_size_2"
    model[2].bias.group_name = "ep_size_4"
    dense = {"params": model.parameters(), "name": "p", "lr": 0.1}
    groups = moe.split_params_into_different_moe_groups_for_optimizer(dense, max_group_size=10)
    assert [(g["name"], g.get("moe", False), [tuple(p.shape) for p in g["params"]]) for g in groups] == [
        ("p", False, [(3, 4), (3,)]),
        ("ep_size_2", True, [(3, 3)]), ("ep_size_2", True, [(3,), (2, 3)]),  # chunks of <= 10 elements
        ("ep_size_4", True, [(2,)])]
    assert groups[0] is dense and all(g["lr"] == 0.1 for g in groups)
    assert moe.expert_group_name(model[2].bias) == "ep_size_4" and moe.expert_group_name(model[0].bias) is None


def test_building_an_moe_layer_is_refused_with_one_line() -> None:
    from dslaunch.moe.layer import MoE

    assert isinstance(MoE, type) and not isinstance(torch.nn.Linear(1, 1), MoE)
    with pytest.raises(NotImplementedError) as err:  # NotInDslaunchError is one
        MoE(hidden_size=84, expert=torch.nn.Linear(84, 84), num_experts=2)
    assert str(err.value) == ("dslaunch.moe.layer.MoE: mixture of experts (expert parallelism) is not in dslaunch; "
                              "train a dense model (the script's non-MoE path), or use DeepSpeed for MoE")
