"""``PipelineModule``: the partition methods, each rank building only its own layers, one-line errors."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import UsageError
from dslaunch.runtime.pipe.module import _partition, partition_balanced, partition_uniform
from tests.distributed import run_world
from tests.runtime.pipe import helpers

pytestmark = pytest.mark.timeout(90)


def test_uniform_gives_the_first_parts_the_extra_layers() -> None:
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(4, 4) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("weights, parts, want", [
    ([3, 1, 1, 3], 2, [0, 2, 4]),
    ([0, 5, 0, 5, 0], 2, [0, 3, 5]),  # a weightless layer stays with the part before it
    ([1, 0, 1, 0, 1, 0, 1, 0], 2, [0, 4, 8]),
    ([0, 0, 0, 5], 2, [0, 3, 4]),  # every part gets a layer, even when the weight is all at the end
    ([9, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2, [0, 1, 10]),
])
def test_balanced_minimises_the_heaviest_part(weights: list[int], parts: int, want: list[int]) -> None:
    assert partition_balanced(weights, parts) == want


@pytest.mark.parametrize("weights, parts, want", [
    ([1, 2, 1], 4, [0, 1, 2, 3, 3]),  # fewer items than parts: one each, the last parts empty
    ([5, 5], 2, [0, 1, 2]),
])
def test_balanced_with_no_more_items_than_parts_is_deepspeeds_answer(weights: list[int], parts: int,
                                                                      want: list[int]) -> None:
    # deepspeed.runtime.utils.partition_balanced is public: it answers, where PipelineModule refuses
    assert partition_balanced(weights, parts) == want


def test_too_few_layers_is_one_line() -> None:
    with pytest.raises(UsageError, match=r"^PipelineModule: 2 layers cannot fill 3 stages"):
        _partition([torch.nn.ReLU(), torch.nn.ReLU()], 3, "parameters")


BUILT: list[str] = []  # per process: which Counted layers were built with real memory


class Counted(torch.nn.Linear):
    def __init__(self, name: str, n_in: int, n_out: int):
        super().__init__(n_in, n_out)
        if self.weight.device.type != "meta":
            BUILT.append(name)


def _build(rank: int, world: int, method: str) -> dict:
    import dslaunch
    from dslaunch.pipe import LayerSpec, PipelineModule

    dslaunch.init_distributed(verbose=False)
    specs = [LayerSpec(Counted, "a", 4, 64), LayerSpec(torch.nn.ReLU), LayerSpec(Counted, "b", 64, 4),
             LayerSpec(torch.nn.ReLU), LayerSpec(Counted, "c", 4, 4), LayerSpec(torch.nn.ReLU)]
    module = PipelineModule(specs, num_stages=2, partition_method=method)
    return {"parts": module.parts, "built": list(BUILT), "names": [n for n, _ in module.named_children() if n != "tied_modules"],
            "out": module(torch.ones(3, 4)).shape[1] if rank == 0 else None}


@pytest.mark.parametrize("method, parts, built", [
    ("uniform", [0, 3, 6], [["a", "b"], ["c"]]),
    ("parameters", [0, 2, 6], [["a"], ["b", "c"]]),  # 4*64+64 = 320 vs 260 + 20
    ("type:counted", [0, 4, 6], [["a", "b"], ["c"]]),  # 2 + 1 matching layers; ReLUs follow their Linear
    ("TYPE:relu", [0, 5, 6], [["a", "b", "c"], []]),  # case-insensitive; 2 of 3 ReLUs fit one stage
])
def test_each_rank_builds_only_its_layers(method: str, parts: list[int], built: list[list[str]]) -> None:
    got = run_world(_build, 2, method)
    for rank, r in enumerate(got):
        assert r["parts"] == parts and r["built"] == built[rank]
        assert r["names"] == [str(i) for i in range(parts[rank], parts[rank + 1])]  # global layer indices
    assert got[0]["out"] in (64, 4)


def _errors(rank: int, world: int) -> list[str]:
    import dslaunch
    from dslaunch.pipe import LayerSpec, PipelineModule

    out = []
    try:
        PipelineModule([LayerSpec(torch.nn.ReLU)] * 4, num_stages=2)
    except UsageError as err:
        out.append(str(err))
    dslaunch.init_distributed(verbose=False)
    layers = [LayerSpec(torch.nn.Linear, 2, 2), LayerSpec(torch.nn.ReLU)]
    cases = ({"num_stages": 3}, {"num_stages": 2, "partition_method": "best"},
             {"num_stages": 2, "partition_method": "type:("}, {"num_stages": 2, "partition_method": "type:Conv"},
             {}, {"num_stages": 2, "activation_checkpoint_interval": -1})
    calls = [lambda kwargs=kwargs: PipelineModule(layers, **kwargs) for kwargs in cases]
    return out + helpers.error_lines([*calls, lambda: LayerSpec(len)], UsageError)


def test_bad_arguments_are_one_line_each() -> None:
    msgs = run_world(_errors, 2)[0]
    assert msgs[0] == "PipelineModule needs torch.distributed: call deepspeed.init_distributed() first"
    assert msgs[1] == "PipelineModule: num_stages=3 must divide the world size 2"
    assert msgs[2] == ("PipelineModule: partition_method 'best' is not one of 'parameters', 'uniform', "
                       "'type:<regex>'")
    assert msgs[3].startswith("PipelineModule: partition_method 'type:(' is not a valid regular expression")
    assert msgs[4] == "PipelineModule: partition_method 'type:Conv' matches no layer type (types: ['Linear', 'ReLU'])"
    assert msgs[5] == "PipelineModule: give num_stages=<int> or topology=<ProcessTopology>"
    assert msgs[6].startswith("PipelineModule: activation_checkpoint_interval must be >= 0")
    assert msgs[7].startswith("LayerSpec: typename must be a torch.nn.Module subclass")
    assert len(msgs) == 8 and not any("\n" in m for m in msgs)


def _checkpointing(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.pipe import PipelineModule
    from dslaunch.runtime.activation_checkpointing import checkpointing

    dslaunch.init_distributed(verbose=False)
    torch.manual_seed(0)
    layers = [torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)]
    calls: list[int] = []

    def counted(function, *args):
        calls.append(1)
        return checkpointing.non_reentrant_checkpoint(function, *args)

    module = PipelineModule(layers, num_stages=1, activation_checkpoint_interval=4, dynamic_shape=True)
    default_func = module.activation_checkpoint_func
    first = list(module.is_checkpointable_results)
    module.activation_checkpoint_func = counted
    module.set_checkpoint_interval(1)  # a ReLU alone has no weights: only the Linear chunks are checkpointed
    out = {"default": default_func is checkpointing.checkpoint, "first": first,
           "second": list(module.is_checkpointable_results)}
    module(torch.ones(2, 4)).sum().backward()
    out["calls"] = len(calls)
    for shape in [(3, 4), (5, 4)]:  # dynamic_shape: any batch shape runs (one stage)
        module(torch.ones(*shape))
    engine, _, _, _ = dslaunch.initialize(model=PipelineModule(list(layers), num_stages=1), config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "pipeline": {"activation_checkpoint_interval": 0, "use_reentrant": False}})
    out["non_reentrant"] = engine.module.activation_checkpoint_func is checkpointing.non_reentrant_checkpoint
    out["reentrant_query"] = engine._reentrant_activation_checkpointing()
    return out


def test_checkpoint_interval_setter_and_use_reentrant() -> None:
    (got,) = run_world(_checkpointing, 1, timeout=80)
    assert got["default"], "DeepSpeed's default: deepspeed.checkpointing.checkpoint"
    assert got["first"] == [True] and got["second"] == [False, True, False, True], got
    assert got["calls"] == 2, got
    assert got["non_reentrant"] and not got["reentrant_query"], got
