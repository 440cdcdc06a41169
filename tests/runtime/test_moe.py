"""``deepspeed.moe`` without experts: the dense answers of the parameter helpers, MoE refused on use."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import NotInDslaunchError
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
    with pytest.raises(NotInDslaunchError, match="mixture of experts"):
        moe.split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "name": "p"})


def test_building_an_moe_layer_is_refused_with_one_line() -> None:
    from dslaunch.moe.layer import MoE

    assert isinstance(MoE, type) and not isinstance(torch.nn.Linear(1, 1), MoE)
    with pytest.raises(NotImplementedError) as err:  # NotInDslaunchError is one
        MoE(hidden_size=84, expert=torch.nn.Linear(84, 84), num_experts=2)
    assert str(err.value) == ("dslaunch.moe.layer.MoE: mixture of experts (expert parallelism) is not in dslaunch; "
                              "train a dense model (the script's non-MoE path), or use DeepSpeed for MoE")
