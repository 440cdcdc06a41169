"""DeepSpeed's hand-built AutoTP layers (``deepspeed.module_inject.layers``), its split
(``tp_shard``), ``partition_config``'s plan, and the whole state dict of a split model.

The layers run on 2 gloo ranks against the unsplit ``nn.Linear`` they wrap: outputs, weight, bias
and input gradients equal (uneven splits included), parameters gathered whole and cut back.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.partition_config import parse_partition_config
from tests.distributed import run_world

pytestmark = pytest.mark.timeout(120)


def _reference(linear: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, nn.Linear]:
    """Output, input gradient and the gradients (on a copy) of ``(linear(x) ** 2).sum()``."""
    ref = copy.deepcopy(linear)
    x = x.detach().clone().requires_grad_(True)
    out = ref(x)
    (out ** 2).sum().backward()
    return out.detach(), x.grad, ref


def _layers(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dslaunch.module_inject.layers import (
        GatherReplacedLayerParams,
        LinearAllreduce,
        LinearLayer,
        set_autotp_mode,
    )
    from dslaunch.module_inject.tp_shard import get_shard_size_list
    from dslaunch.runtime.utils import is_model_parallel_parameter

    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    column, row = nn.Linear(6, 5), nn.Linear(7, 4)  # 5 outputs and 7 inputs: uneven over 2 ranks
    x, x_row = torch.randn(3, 6), torch.randn(3, 7)
    checks: dict[str, bool] = {}

    set_autotp_mode(training=False)
    checks["inference frozen"] = not LinearLayer(copy.deepcopy(column), group).weight.requires_grad
    set_autotp_mode(training=True)
    frozen = copy.deepcopy(column).requires_grad_(False)
    checks["training keeps a frozen Linear frozen"] = not LinearLayer(frozen, group).weight.requires_grad

    for gather in (False, True):
        out_ref, grad_x_ref, ref = _reference(column, x)
        module = copy.deepcopy(column)
        layer = LinearLayer(module, group, gather_output=gather)
        sizes = get_shard_size_list(5, world, None)
        start, stop = sum(sizes[:rank]), sum(sizes[:rank + 1])
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        (out ** 2).sum().backward()
        tag = "gathered column" if gather else "column"
        checks[f"{tag} output"] = torch.allclose(out, out_ref if gather else out_ref[:, start:stop], atol=1e-6)
        checks[f"{tag} weight grad"] = torch.allclose(layer.weight.grad, ref.weight.grad[start:stop], atol=1e-6)
        checks[f"{tag} bias grad"] = torch.allclose(layer.bias.grad, ref.bias.grad[start:stop], atol=1e-6)
        checks[f"{tag} input grad"] = torch.allclose(xi.grad, grad_x_ref, atol=1e-6)  # summed over the group
        checks[f"{tag} keeps the Parameters"] = layer.weight is module.weight and layer.bias is module.bias
        checks[f"{tag} marks"] = is_model_parallel_parameter(layer.weight) and is_model_parallel_parameter(layer.bias)

    out_ref, _, ref = _reference(row, x_row)
    layer = LinearAllreduce(copy.deepcopy(row), group)
    sizes = get_shard_size_list(7, world, None)
    start, stop = sum(sizes[:rank]), sum(sizes[:rank + 1])
    out = layer(x_row[:, start:stop])
    (out ** 2).sum().backward()
    checks["row output"] = torch.allclose(out, out_ref, atol=1e-6)
    checks["row weight grad"] = torch.allclose(layer.weight.grad, ref.weight.grad[:, start:stop], atol=1e-6)
    checks["row bias grad (whole)"] = torch.allclose(layer.bias.grad, ref.bias.grad, atol=1e-6)
    checks["row bias unmarked"] = (is_model_parallel_parameter(layer.weight)
                                   and not is_model_parallel_parameter(layer.bias))

    twin = copy.deepcopy(layer)  # shares the group (which cannot be copied), owns its Parameters
    checks["deep copy"] = (twin.mp_group is group and twin.weight is not layer.weight
                           and torch.equal(twin(x_row[:, start:stop]), out.detach()))
    layer.weight.gather_params([layer.weight])
    checks["gathered whole"] = torch.equal(layer.weight, row.weight)
    layer.weight._tp_partition([layer.weight])
    checks["cut back"] = torch.equal(layer.weight, row.weight[:, start:stop])
    with GatherReplacedLayerParams(list(layer.parameters()), layer):
        checks["whole in the block"] = torch.equal(layer.weight, row.weight)
    checks["slice after the block"] = layer.weight.shape == (4, stop - start)
    dist.destroy_process_group()
    return checks


def test_the_hand_built_layers_compute_the_unsplit_linear() -> None:
    for rank, checks in enumerate(run_world(_layers, 2)):
        failed = [name for name, ok in checks.items() if not ok]
        assert not failed, (rank, failed)


def test_shard_sizes_follow_deepspeeds_split() -> None:
    from dslaunch.module_inject.tp_shard import AutoTPMeta, get_shard_size_list

    assert get_shard_size_list(129, 4, None) == [33, 32, 32, 32]  # near even, the first ranks longer
    assert get_shard_size_list(129, 4, "lm_head") == [33, 32, 32, 32]  # 0.19.6's (total, tp, name)
    three_kv = AutoTPMeta(num_kv_heads=3)
    assert get_shard_size_list(96, 2, three_kv, "attn.q") == [64, 32]  # whole KV heads: 2 and 1
    assert get_shard_size_list(96, 2, three_kv, "mlp.up") == [48, 48]  # MLP layers: even
    assert get_shard_size_list(100, 3, AutoTPMeta(tp_grain_size=8), "x") == [32, 32, 36]  # the grain's tail last
    assert AutoTPMeta.from_model_config(type("C", (), {"num_attention_heads": 8, "num_key_value_heads": 2,
                                                       "hidden_size": 32})()) == AutoTPMeta(2, 8, 32)


class _Fused(nn.Module):
    """A fused qkv (q 8, k 4, v 4 features) feeding an output projection, an embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.qkv, self.out, self.lm_head = nn.Linear(8, 16), nn.Linear(8, 8), nn.Linear(8, 10)
        self.config = type("Config", (), {"model_type": "toy"})()


def _plan(rules: dict, rank: int, tp: int = 2):
    from dslaunch.runtime.tensor_parallel.partition import plan_from_rules

    return plan_from_rules(_Fused(), parse_partition_config("tensor_parallel.partition_config", rules), tp, rank)


def test_partition_config_plans_what_its_rules_say() -> None:
    rules = {"layer_specs": [
        {"patterns": [r"qkv\.weight$"], "partition_type": "column", "shape": [[8, 4, 4], -1]},
        {"patterns": [r"out\.weight$"], "partition_type": "row"},
        {"patterns": [r"lm_head\.weight$"], "partition_type": "column", "gather_output": True,
         "model_types": ["TOY"]}]}
    plans = [_plan(rules, rank) for rank in (0, 1)]
    got = [{s.name: (s.kind, s.segments, s.widths) for s in plan.shards} for plan in plans]
    assert got[1]["qkv"] == ("column", ((4, 8), (10, 12), (14, 16)), ())  # each sub-parameter's second half
    assert got[0]["out"] == ("row", ((0, 4),), ())
    assert got[0]["lm_head"] == ("vocab", ((0, 5),), (5, 5))  # gathered: every rank's width
    assert plans[0].replicated == ()  # the embedding is no Linear; every Linear was matched
    other_model = {"layer_specs": [{**rules["layer_specs"][2], "model_types": ["llama"]}]}
    assert _plan(other_model, 0).replicated == ("qkv", "out", "lm_head")  # no rule applies: all whole


@pytest.mark.parametrize("rules, message", [
    ({"strict_mode": True, "layer_specs": [{"patterns": ["qkv"], "partition_type": "skip"}]},
     "strict_mode: no layer_specs pattern matches out.weight"),
    ({"layer_specs": [{"patterns": [r".*\.weight$"], "partition_type": "column"}]},
     "embed.weight (Embedding) matches a column rule: only Linear layers are split"),
    ({"layer_specs": [{"patterns": ["lm_head"], "partition_type": "row"}]},
     "lm_head.weight: a row rule on the output layer is not implemented"),
    ({"layer_specs": [{"patterns": ["qkv"], "shape": [[8, 4], -1]}]},
     "qkv.weight: sub-parameter sizes [8, 4] sum to 12, not the weight's 16"),
    ({"layer_specs": [{"patterns": ["qkv"], "shape": [2, -1, 4], "partition_dim": 1}]},
     "qkv.weight: a shape of 3 dimensions split at 1 is not implemented"),
])
def test_partition_config_refusals_are_one_line(rules: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _plan(rules, 0)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def _consolidated(rank: int, world: int, stage: int) -> dict:
    """The whole state dict of a model split by the planner and of one with hand-built layers
    at tp 2 (stage 3 on 4 ranks: each slice partitioned over 2 data-parallel ranks, gathered, then
    joined)."""
    import dslaunch
    from dslaunch.module_inject.layers import LinearAllreduce, LinearLayer
    from dslaunch.utils import groups
    from tests.runtime.tensor_parallel.models import TrainableLM

    config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    torch.manual_seed(0)
    model = TrainableLM()
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    engine = dslaunch.initialize(model=model, config=config)[0]
    planner = engine._consolidated_16bit_state_dict()
    elsewhere = (None, {})  # not rank 0: None, as DeepSpeed's; stage 3's ({}, as ZeRO-3 without AutoTP)
    same = planner in elsewhere if rank else (planner.keys() == whole.keys()
                                         and all(torch.equal(planner[k], whole[k]) for k in whole))
    attn = engine.module.lm.blocks[0].attn
    q = attn.q.weight
    split = (q.ds_shape if stage == 3 else q.shape)[0] < whole["lm.blocks.0.attn.q.weight"].shape[0]
    # the planner's layers answer to DeepSpeed's classes (code that finds the split layers by them)
    classes = (isinstance(attn.q, LinearLayer) and isinstance(attn.o, LinearAllreduce)
               and not isinstance(attn.o, LinearLayer) and isinstance(engine.module.lm.head, LinearLayer))

    torch.manual_seed(1)
    hand = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 6))
    whole_hand = {k: v.clone() for k, v in hand.state_dict().items()}
    group = groups.get_tensor_model_parallel_group()
    hand[0], hand[1] = LinearLayer(hand[0], group), LinearAllreduce(hand[1], group)
    rules = {"layer_specs": [{"patterns": [".*"], "partition_type": "skip"}]}
    engine = dslaunch.initialize(model=hand, config={**config, "tensor_parallel": {"autotp_size": 2,
                                                                                   "partition_config": rules}})[0]
    built = engine._consolidated_16bit_state_dict()
    same_hand = built in elsewhere if rank else all(torch.equal(built[k], whole_hand[k]) for k in whole_hand)
    shapes = [p.ds_shape if stage == 3 else p.shape for p in (hand[0].weight, hand[1].weight)]
    return {"planner": same, "split": split, "classes": classes, "hand-built": same_hand,
            "still split": shapes == [(4, 6), (6, 4)]}


@pytest.mark.parametrize("stage", [1, 3])
def test_the_consolidated_state_dict_is_the_unsplit_models(stage: int) -> None:
    for rank, checks in enumerate(run_world(_consolidated, 2 if stage < 3 else 4, stage, timeout=100)):
        assert all(checks.values()), (rank, checks)


class _HeadNorm(nn.Module):
    """Qwen3's pattern: a whole per-head-dimension weight applied to each (split) head's features."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)  # 2 heads of 4 between them
        self.head_norm = nn.Parameter(torch.linspace(0.5, 2.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = (h.view(*h.shape[:-1], -1, 4) * self.head_norm).flatten(-2)
        return self.fc2(h)


def _grad_allreduce(rank: int, world: int, hooked: bool) -> list[float]:
    import dslaunch

    torch.manual_seed(0)
    model = _HeadNorm()
    rules = {"layer_specs": [{"patterns": [r"fc1\.weight$"], "partition_type": "column"},
                             {"patterns": [r"fc2\.weight$"], "partition_type": "row"},
                             {"patterns": [r"head_norm$"], "partition_type": "skip", "grad_allreduce": hooked}]}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
              "tensor_parallel": {"autotp_size": world, "partition_config": rules if world > 1 else None}}
    engine = dslaunch.initialize(model=model, config=config)[0]
    engine(torch.ones(2, 4)).pow(2).sum().backward()
    return engine.module.head_norm.grad.tolist()


def test_grad_allreduce_sums_a_replicated_parameters_gradient() -> None:
    whole = run_world(_grad_allreduce, 1, False)[0]
    summed, partial = run_world(_grad_allreduce, 2, True)[0], run_world(_grad_allreduce, 2, False)[0]
    assert torch.allclose(torch.tensor(summed), torch.tensor(whole), atol=1e-5), (summed, whole)
    assert not torch.allclose(torch.tensor(partial), torch.tensor(whole), atol=1e-3)  # each rank: its head's part


def test_tp_model_init_conflicts_are_refused_at_initialize() -> None:
    from dslaunch.runtime.tensor_parallel.training import tp_model_init, with_tp_model_init

    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}
    merged = with_tp_model_init(config, tp_model_init(nn.Linear(2, 2), 2, torch.bfloat16))
    assert merged["tensor_parallel"]["autotp_size"] == 2 and "tensor_parallel" not in config  # a copy
    with pytest.raises(ConfigError, match=r"^'bf16': Conflicting dtype: the config enables torch.bfloat16 but "
                                          r"tp_model_init\(dtype=torch.float16\)"):
        with_tp_model_init(config, tp_model_init(nn.Linear(2, 2), 2, torch.float16))
    grouped = tp_model_init(nn.Linear(2, 2), 1, torch.bfloat16, tp_group=object())
    with pytest.raises(ConfigError, match="^tp_model_init provided tp_group; deepspeed.initialize must not"):
        with_tp_model_init(config, grouped, mpu=object())
    with pytest.raises(ConfigError, match=r"^tp_model_init\(tp_group=...\) is not implemented by dslaunch"):
        with_tp_model_init(config, grouped)


def _grid_answers(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.module_inject.layers import is_autotp_training_mode, set_autotp_mode
    from dslaunch.utils import groups

    set_autotp_mode(training=False)
    rules = {"layer_specs": [{"patterns": [".*"], "partition_type": "skip"}]}
    engine = dslaunch.initialize(model=nn.Linear(4, 4), config={
        "train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2, "partition_config": rules}})[0]
    return {"src": groups.get_tensor_model_parallel_src_rank(), "autotp_size": engine.autotp_size(),
            "training mode": is_autotp_training_mode()}


def test_initialize_with_autotp_answers_as_deepspeed() -> None:
    """tp 2 x dp 2: ranks 0-1 and 2-3 are the slices of a replica; their first rank is the source."""
    got = run_world(_grid_answers, 4)
    assert [g["src"] for g in got] == [0, 0, 2, 2]
    assert all(g["autotp_size"] == 2 and g["training mode"] for g in got), got


def _hand_built_checkpoint(rank: int, world: int, path: str) -> bool:
    """A model of hand-built layers saved at tp 2 x dp 2 and loaded at tp 4: the same whole weights."""
    import dslaunch
    from dslaunch.module_inject.layers import LinearAllreduce, LinearLayer, set_autotp_mode

    set_autotp_mode(training=True)  # before the layers are built, as DeepSpeed wants (else they are frozen)

    def engine_at(tp: int, seed: int):
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]  # collective: all of them
        group = groups[rank // tp]  # the slices of one replica: neighbouring ranks, as the engine's grid
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
        model[0], model[2] = LinearLayer(model[0], group), LinearAllreduce(model[2], group)
        rules = {"layer_specs": [{"patterns": [".*"], "partition_type": "skip"}]}
        return dslaunch.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": tp, "partition_config": rules}})[0]

    saved = engine_at(2, 0)
    torch.manual_seed(100 + saved.grid.get_data_parallel_rank())
    saved.backward(saved(torch.randn(2, 8)).pow(2).mean())
    saved.step()
    saved.save_checkpoint(path, tag="tp2")
    before = saved._consolidated_16bit_state_dict()
    loaded = engine_at(4, 1)
    loaded.load_checkpoint(path, tag="tp2")
    after = loaded._consolidated_16bit_state_dict()
    return before is None or all(torch.equal(before[k], after[k]) for k in before)


def test_hand_built_layers_checkpoint_at_one_degree_loads_at_another(tmp_path) -> None:
    assert all(run_world(_hand_built_checkpoint, 4, str(tmp_path), timeout=100))
