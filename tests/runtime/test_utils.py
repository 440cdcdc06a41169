"""``deepspeed.runtime.utils`` (``dslaunch.runtime.utils``): DeepSpeed's signatures and effects.

The parameter lists below are DeepSpeed 0.19's (read from its source), so a script calling with
keywords keeps working; the effects are checked against plain torch/NumPy/random."""

from __future__ import annotations

import inspect
import itertools
import math
import random

import numpy
import pytest
import torch

from dslaunch.runtime import utils
from tests.distributed import run_world

pytestmark = pytest.mark.timeout(60)

DEEPSPEED_PARAMETERS = {
    "set_random_seed": ["seed"],
    "see_memory_usage": ["message", "force"],
    "memory_status": ["msg", "print_rank", "reset_max"],
    "clip_grad_norm_": ["parameters", "max_norm", "norm_type", "mpu"],
    "get_global_norm": ["norm_list"],
    "get_grad_norm": ["parameters", "norm_type", "mpu"],
    "get_weight_norm": ["parameters", "norm_type", "mpu"],
    "move_to_device": ["item", "device", "criterion_func"],
    "partition_uniform": ["num_items", "num_parts"],
    "partition_balanced": ["weights", "num_parts"],
    "call_to_str": ["base", "args", "kwargs"],
    "CheckOverflow": ["param_groups", "mpu", "zero_reduce_scatter", "deepspeed"],
    "has_inf_or_nan": ["x"],
    "is_invalid_grad_norm": ["norm"],
}


@pytest.mark.parametrize("name", sorted(DEEPSPEED_PARAMETERS))
def test_signature_is_deepspeeds(name: str) -> None:
    assert list(inspect.signature(getattr(utils, name)).parameters) == DEEPSPEED_PARAMETERS[name]


def test_set_random_seed_seeds_python_numpy_and_torch() -> None:
    utils.set_random_seed(1234)
    got = (random.random(), numpy.random.rand(), torch.rand(2))
    random.seed(1234)
    numpy.random.seed(1234)
    torch.manual_seed(1234)
    want = (random.random(), numpy.random.rand(), torch.rand(2))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])
    utils.set_random_seed(2 ** 64 + 5)  # too large for NumPy and torch: reduced, as DeepSpeed does
    assert numpy.random.get_state()[1][0] == numpy.random.RandomState(5).get_state()[1][0]


def test_see_memory_usage_prints_only_when_forced(capsys: pytest.CaptureFixture[str]) -> None:
    utils.see_memory_usage("before the model", force=False)
    assert capsys.readouterr().out == ""
    utils.see_memory_usage("before the model", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "before the model"
    assert lines[1].startswith("MA ") and "Max_CA" in lines[1]
    assert lines[2].startswith("CPU Virtual Memory:  used = ") and lines[2].endswith("%")


def _grads(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 10
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_matches_torch_on_one_process(norm_type: float) -> None:
    ours, theirs = _grads(0), _grads(0)
    total = utils.clip_grad_norm_(ours, max_norm=1.0, norm_type=norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm=1.0, norm_type=norm_type)
    assert torch.allclose(total.reshape(()), want, rtol=1e-6)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    assert utils.clip_grad_norm_(ours, max_norm=1.0, norm_type=norm_type).item() == pytest.approx(1.0, rel=1e-4)


def test_clip_grad_norm_leaves_small_gradients_alone() -> None:
    params = _grads(1)
    before = [p.grad.clone() for p in params]
    utils.clip_grad_norm_(params, max_norm=1e6)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))


def _clip_on_rank(rank: int, world_size: int) -> tuple[float, list[float]]:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        params = _grads(7)  # data-parallel ranks hold the same (reduced) gradients
        total = utils.clip_grad_norm_(params, max_norm=2.0)
        return total.item(), [p.grad.norm().item() for p in params]
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_clip_grad_norm_agrees_across_data_parallel_ranks() -> None:
    reference = _grads(7)
    want = torch.nn.utils.clip_grad_norm_(reference, max_norm=2.0).item()
    results = run_world(_clip_on_rank, 2)
    for total, norms in results:
        assert total == pytest.approx(want, rel=1e-6)
        assert norms == pytest.approx([p.grad.norm().item() for p in reference], rel=1e-5)


def test_norms() -> None:
    assert utils.get_global_norm([3.0, 4.0]) == 5.0
    params = _grads(2)
    flat = torch.cat([p.detach().flatten() for p in params])
    assert utils.get_weight_norm(params) == pytest.approx(flat.norm().item(), rel=1e-6)
    assert utils.get_weight_norm(params, norm_type=math.inf) == pytest.approx(flat.abs().max().item())
    grads = torch.cat([p.grad.flatten() for p in params])
    assert utils.get_grad_norm(params) == pytest.approx(grads.norm().item(), rel=1e-6)
    params[0].grad[0, 0] = float("nan")
    assert utils.get_grad_norm(params) == -1  # DeepSpeed's answer for a non-finite norm
    replicated = torch.nn.Parameter(torch.full((4,), 100.0))
    replicated.ds_pipe_replicated = True  # counted on its owning stage only
    assert utils.get_weight_norm([*params, replicated]) == pytest.approx(flat.norm().item(), rel=1e-6)


def test_move_to_device_nested_and_in_place() -> None:
    t = torch.ones(2, dtype=torch.float64)
    out = utils.move_to_device({"a": [t, (t, 3)], "b": "text"}, "cpu")
    assert out["b"] == "text" and out["a"][1][1] == 3 and isinstance(out["a"][1], tuple)
    param = torch.nn.Parameter(torch.ones(2))  # accepted: moved in place, the same Parameter back
    assert utils.move_to_device([param], "cpu", criterion_func=lambda x: isinstance(x, torch.nn.Parameter))[0] is param


def test_small_helpers() -> None:
    assert utils.call_to_str("f", 1, "a", key=2) == "f(1, 'a', key=2)"
    assert utils.prefix_sum_inc([3, 4, 5]) == [3, 7, 12]
    assert utils.partition_uniform(10, 3) == [0, 4, 7, 10]  # DeepSpeed: the first parts get the rest
    assert utils.get_only_unique_item([2, 2]) == 2
    with pytest.raises(RuntimeError, match="only one unique element"):
        utils.get_only_unique_item([1, 2])
    assert utils.noop_decorator(len) is len
    with utils.noop_context():
        pass
    assert utils.DummyOptim([torch.nn.Parameter(torch.ones(1))]).param_groups[0]["params"][0].item() == 1.0


def _partitioned_round_trip(rank: int, world: int, shape: tuple[int, ...]) -> tuple[list[int], bool, bool, int]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) * 1.5 - 7
    part = utils.PartitionedTensor(full, group=None)
    rebuilt = utils.PartitionedTensor.from_meta(part.to_meta(), part.data(), None).full()
    return list(part.local_size()), torch.equal(part.full(), full), torch.equal(rebuilt, full), part.data().numel()


@pytest.mark.parametrize("shape", [(16, 3), (15, 5), (2,)])
def test_partitioned_tensor_splits_flat_and_gathers_back(shape: tuple[int, ...]) -> None:
    """Each of 4 ranks keeps its ``partition_uniform`` piece of the flat tensor; ``full()`` and a
    ``from_meta`` rebuild give the tensor back exactly, even when 4 does not divide it (2 < 4
    elements leaves ranks with nothing)."""
    results = run_world(_partitioned_round_trip, 4, shape)
    offsets = utils.partition_uniform(math.prod(shape), 4)
    assert [r[3] for r in results] == [b - a for a, b in itertools.pairwise(offsets)]
    assert all(len(r[0]) == 1 and r[1] and r[2] for r in results)


def _meta_of_other_rank(rank: int, world: int) -> str:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    part = utils.PartitionedTensor(torch.ones(8), group=None)
    meta = part.to_meta()
    meta[-(world + 2)] = (rank + 1) % world  # the rank field: claim another rank's piece
    try:
        utils.PartitionedTensor.from_meta(meta, part.data(), None)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_partitioned_tensor_meta_is_deepspeeds_layout_and_checked() -> None:
    """``to_meta`` is DeepSpeed's wire layout ``[ndim, *shape, parts, rank, *offsets]``; a meta of
    another rank's piece is refused in one line rather than rebuilt wrong."""
    assert run_world(_meta_layout, 2) == [[2, 3, 2, 2, 0, 0, 3, 6], [2, 3, 2, 2, 1, 0, 3, 6]]
    errors = run_world(_meta_of_other_rank, 2)
    assert all("\n" not in e and "pass the meta this rank's piece was made with" in e for e in errors)


def _meta_layout(rank: int, world: int) -> list[int]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return utils.PartitionedTensor(torch.zeros(3, 2), group=None).to_meta().tolist()


def _overflow_on_rank(rank: int, world: int) -> dict:
    """Rank 1 alone has an inf in a dense and in an expert gradient (DeepSpeed's TestCheckOverflow)."""
    import dslaunch
    from dslaunch.utils import groups

    dslaunch.init_distributed(verbose=False)
    groups._create_expert_and_data_parallel(2)
    dense, expert = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    expert.allreduce = False  # DeepSpeed's mark of an expert parameter
    bad = torch.tensor([1.0, float("inf") if rank == 1 else 1.0])
    dense.grad, expert.grad = bad.clone(), bad.clone()
    out = {"dense": utils.CheckOverflow([[dense]]).check(),  # no expert, no mpu: this rank's own answer
           "expert": utils.CheckOverflow([[dense, expert]]).check(),  # over the expert group
           "passed_in": utils.CheckOverflow().check([[expert]])}
    norm = utils.get_weight_norm([dense.grad])
    out["norm"] = (norm, utils.CheckOverflow([[dense]]).check_using_norm([norm]))  # over every rank
    out["norm_local"] = utils.CheckOverflow([[dense]]).check_using_norm([norm], reduce_overflow=False)
    return out


@pytest.mark.timeout(120)
def test_check_overflow_sees_an_inf_on_any_rank_where_deepspeeds_does() -> None:
    for rank, got in enumerate(run_world(_overflow_on_rank, 2)):
        assert got["dense"] is (rank == 1)
        assert got["expert"] is True and got["passed_in"] is True
        assert got["norm"] == (pytest.approx(-1.0 if rank == 1 else math.sqrt(2.0)), True)
        assert got["norm_local"] is (rank == 1)


def test_has_inf_or_nan_and_invalid_norms() -> None:
    assert not utils.has_inf_or_nan(torch.ones(3)) and not utils.has_inf_or_nan(torch.empty(0))
    for bad in (float("inf"), float("-inf"), float("nan")):
        assert utils.has_inf_or_nan(torch.tensor([1.0, bad], dtype=torch.float16))
        assert utils.is_invalid_grad_norm(bad) and utils.is_invalid_grad_norm(torch.tensor([bad]))
    assert utils.has_inf_or_nan(torch.sparse_coo_tensor([[1]], [float("nan")], (4,)))
    assert utils.is_invalid_grad_norm(-1.0) and not utils.is_invalid_grad_norm(torch.tensor(2.0))
