"""AutoEP folded with AutoTP (DeepSpeed's AutoEP+AutoTP folding): on 4 gloo ranks, tensor 2 x data
2 with experts over 2 neighbouring ranks, a Mixtral-style model (router, fused experts, a dense
MLP that AutoTP splits) trains three SGD steps with gradient clipping at ZeRO 0, 1, 2 and 3 (every
parameter partitioned), and with the padded dispatch, to the losses, global norms and weights of
the unconverted model trained in one process; the folded groups are asserted. Also resuming from a
checkpoint, the route split, the folding record and the config's refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config
from dslaunch.runtime.moe.autoep_folded import route_lanes
from tests.distributed import run_world
from tests.runtime.moe.test_autoep import EXPERTS, FFN, HIDDEN, TOP_K, Block

LAYERS = 2


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN)
        self.mlp = Block()  # test_autoep.py's: a linear router and Hugging Face 5's fused experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(torch.tanh(self.up(self.norm(x))))
        return x + self.mlp(x)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = SimpleNamespace(num_experts_per_tok=TOP_K)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer(x)
        return self.head(x).square().mean()


# AutoTP splits the dense MLP; the router rule would split the router too, but AutoTP leaves the
# blocks AutoEP converts whole
RULES = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.up\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.down\.weight$"], "partition_type": "row"},
    {"patterns": [r".*\.mlp\.router\.weight$"], "partition_type": "column"}]}
BLOCKS = {"moe_layer_pattern": r"model\.layers\.\d+\.mlp", "router_pattern": "router", "expert_pattern": "mlp_experts",
          "top_k_attr": "num_experts_per_tok", "use_grouped_mm": False}


def _config(stage: int, ep: int = 2, **extra: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.05, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
            "tensor_parallel": {"autotp_size": 2, "partition_config": RULES},
            "expert_parallel": {"enabled": True, "autoep_size": ep, **BLOCKS},
            **extra}


def _batch(replica: int, step: int) -> torch.Tensor:
    return torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(100 * step + replica))


def _folded(rank: int, world: int, stage: int, padded: bool, ep: int) -> dict:
    import torch.distributed as dist

    import dslaunch as deepspeed
    from dslaunch.runtime.moe.autoep import AutoEPMoE

    config = _config(stage, ep)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # stage 3: every parameter partitioned
    engine, *_ = deepspeed.initialize(model=Net(), config=config)
    blocks = [m for m in engine.module.modules() if isinstance(m, AutoEPMoE)]
    for block in blocks:
        block.padded = padded
    handles = blocks[0].folding_group_handles
    groups = {"tp": handles.tp_ranks, "dense_dp": handles.dense_dp_ranks, "ep": handles.ep_ranks,
              "edp": handles.edp_ranks, "ep_group": tuple(dist.get_process_group_ranks(blocks[0].ep_group)),
              "router": _shape(blocks[0].gate.router.weight), "up": _shape(engine.module.model.layers[0].up.weight)}
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    out: dict = {"groups": groups, "loss": 0.0, "norm": 0.0}
    replica, replicas = rank // 2, world // 2
    for step in range(3):
        want = sum(ref(_batch(r, step)) for r in range(replicas)) / replicas
        want.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        loss = engine(_batch(replica, step))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out["loss"] = max(out["loss"], abs(mean.item() / world - want.item()))
        out["norm"] = max(out["norm"], abs(engine.get_global_grad_norm() - norm.item()))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # stage 3: whole again
        out["weights"] = _weight_error(engine.module, ref, blocks)
    return out


def _shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))  # stage 3: the whole shape of a partitioned one


def _weight_error(module: torch.nn.Module, ref: torch.nn.Module, blocks: list) -> float:
    """The largest difference between the trained weights and the reference's: experts gathered over
    their expert group, tensor slices over the tensor group."""
    import torch.distributed as dist

    want = dict(ref.named_parameters())
    worst = 0.0
    for name, p in module.named_parameters():
        whole = p.detach()
        if ".experts." in name:
            group = blocks[0].ep_group
        elif name.endswith(("up.weight", "up.bias", "down.weight")):
            group = blocks[0].tp_group
        else:
            group = None
        if group is not None:
            parts = [torch.empty_like(whole) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, whole.contiguous(), group=group)
            whole = torch.cat(parts, dim=1 if name.endswith("down.weight") else 0)
        target = want[name.replace(".gate.router.", ".router.").replace(".experts.", ".mlp_experts.")]
        worst = max(worst, (whole - target).abs().max().item())
    return worst


@pytest.mark.parametrize(("stage", "padded", "ep"), [(0, False, 2), (1, False, 2), (2, False, 2), (2, True, 2),
                                                   (3, False, 2), (0, False, 4), (2, False, 4), (3, False, 4)])
def test_folded_training_equals_the_unconverted_model_in_one_process(stage: int, padded: bool, ep: int) -> None:
    """ep 2: the expert groups are the tensor groups; ep 4: one expert group spans both replicas."""
    results = run_world(_folded, 4, stage, padded, ep)
    for rank, got in enumerate(results):
        lane, replica = rank % 2, rank // 2
        experts = (2 * replica, 2 * replica + 1) if ep == 2 else (0, 1, 2, 3)
        assert got["groups"] == {"tp": (2 * replica, 2 * replica + 1), "dense_dp": (lane, lane + 2),
                                 "ep": experts, "edp": (lane, lane + 2) if ep == 2 else (rank,),
                                 "ep_group": experts, "router": (EXPERTS, HIDDEN),
                                 "up": (HIDDEN, HIDDEN)}, f"rank {rank}"
        assert max(got["loss"], got["norm"], got["weights"]) <= 2e-5, f"rank {rank}: {got}"


def test_each_experts_routes_split_once_over_the_slices() -> None:
    experts = torch.tensor([2, 0, 2, 2, 1, 0, 2])
    assert route_lanes(experts, 3, 2).tolist() == [0, 0, 1, 0, 0, 1, 1]
    lanes = route_lanes(torch.randint(0, 4, (50,), generator=torch.Generator().manual_seed(0)), 4, 3)
    for lane in range(3):
        assert ((lanes == lane).sum() - 50 / 3).abs() <= 4


@pytest.mark.parametrize(("extra", "key", "says"), [
    ({"expert_parallel": {"enabled": True, "autoep_size": 1}}, "expert_parallel.autoep_size", "needs autoep_size > 1"),
    ({"use_data_before_expert_parallelism": True}, "use_data_before_expert_parallelism", "set it to false"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer", "turn offload off"),
])
def test_folding_refuses_what_it_cannot_fold_in_one_line(extra: dict, key: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({**_config(0), **extra}, 4)
    assert key in str(err.value) and says in str(err.value) and "\n" not in str(err.value)


def _resumed(rank: int, world: int, stage: int, ep: int, root: str) -> dict:
    """Two steps, a save, a third step; then a fresh engine loads the tag and takes the third step:
    the same loss and weights (exact). An engine of another expert size is refused in one line."""
    import dslaunch as deepspeed
    from dslaunch.errors import CheckpointError

    config = {**_config(stage, ep), "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = deepspeed.initialize(model=Net(), config=config)
    for step in range(3):
        if step == 2:
            engine.save_checkpoint(root, tag="folded")
        loss = engine(_batch(rank // 2, step))
        engine.backward(loss)
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # stage 3: whole again
        want = ({n: p.detach().clone() for n, p in engine.module.named_parameters()}, loss.item())
    torch.manual_seed(1)  # another start: the load must bring every weight back
    fresh, *_ = deepspeed.initialize(model=Net(), config=config)
    fresh.load_checkpoint(root, tag="folded")
    loss = fresh(_batch(rank // 2, 2))
    fresh.backward(loss)
    fresh.step()
    with deepspeed.zero.GatheredParameters(list(fresh.module.parameters())):
        got = {n: p.detach().clone() for n, p in fresh.module.named_parameters()}
    other, *_ = deepspeed.initialize(model=Net(), config={**config, **_config(stage, 6 - ep)})
    try:
        other.load_checkpoint(root, tag="folded")
        refused = ""
    except CheckpointError as err:
        refused = str(err)
    return {"loss": abs(loss.item() - want[1]), "weights": max((got[n] - w).abs().max().item() for n, w in want[0].items()),
            "steps": fresh.global_steps, "refused": refused}


@pytest.mark.parametrize(("stage", "ep"), [(0, 2), (0, 4), (1, 4), (2, 2), (3, 4)])
def test_a_folded_run_resumes_exactly_from_its_checkpoint(stage: int, ep: int, tmp_path: object) -> None:
    for rank, got in enumerate(run_world(_resumed, 4, stage, ep, str(tmp_path))):
        refused = got.pop("refused")
        assert got == {"loss": 0.0, "weights": 0.0, "steps": 3}, f"rank {rank}: {got}"
        # the folding record's check, or the shard read's expert-layout check first (naming both layouts)
        assert (f"'ep_size': {ep}" in refused and "loads only at the same tensor, expert and data sizes" in refused
                or "Beside model parallelism MoE checkpoints load only at their saving layout" in refused), refused
        assert "\n" not in refused


def test_the_folding_record_names_the_field_that_differs() -> None:
    from dslaunch.runtime.moe.folding_metadata import make_folding_metadata, validate_folding_metadata

    record = make_folding_metadata(tp_size=2, tp_rank=1, ep_size=4, ep_rank=3, zero_partition_group="edp",
                                   zero_partition_rank=1, zero_partition_count=2, family="routed_expert")
    assert (record["version"], record["etp_size"], record["dispatch_strategy"]) == (1, 1, "route_full_partition_dispatch")
    saved = {"folding": record}
    assert validate_folding_metadata(saved, tp_size=2, ep_size=4, zero_partition_group="edp") is record
    for given, field in (({"tp_size": 1, "ep_size": 4}, "tp_size"), ({"tp_size": 2, "ep_size": 4, "tp_rank": 0}, "tp_rank"),
                         ({"tp_size": 2, "ep_size": 4, "family": "dense"}, "family")):
        with pytest.raises(RuntimeError, match=f"mismatch for {field}: saved="):
            validate_folding_metadata(saved, **given)
    with pytest.raises(RuntimeError, match="Missing AutoEP\\+AutoTP folding metadata"):
        validate_folding_metadata({}, tp_size=2, ep_size=4)


def test_deepspeeds_record_of_a_block_builds_the_same_converted_block() -> None:
    from dslaunch.runtime.config.expert_parallel import ExpertParallelConfig
    from dslaunch.runtime.moe.autoep import AutoEPMoE
    from dslaunch.runtime.moe.autoep_presets import detect
    from dslaunch.runtime.moe.autoep_spec import MoELayerSpec

    fields = dict(moe_module_name="model.layers.0.mlp", model_family="custom", router_name="router",
                  experts_name="mlp_experts", expert_storage="fused_3d", expert_w1_name="gate_up_proj",
                  expert_w2_name="down_proj", expert_w3_name=None, num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN,
                  ffn_hidden_size=FFN, score_func="softmax", score_apply="post", route_norm=True, gate_bias=False,
                  return_router_logits=False, router_logits_capture_target="none", router_logits_capture_index=None,
                  router_logits_capture_layer_name=None, has_shared_experts=False, shared_experts_name="")
    cfg = ExpertParallelConfig(enabled=True, autoep_size=1, **BLOCKS)
    block = Net().model.layers[0].mlp
    theirs = AutoEPMoE(MoELayerSpec(**fields), block, 1, 0, cfg)
    ours = AutoEPMoE(detect(Net(), cfg)[0], Net().model.layers[0].mlp, 1, 0, cfg)
    x = torch.randn(5, HIDDEN)
    assert torch.equal(theirs(x), ours(x)) and (theirs(x) - block(x)).abs().max() <= 1e-6
    with pytest.raises(ConfigError, match="'MoELayerSpec.expert_storage': 'module_list' is not converted") as err:
        MoELayerSpec(**{**fields, "expert_storage": "module_list"}).layer_spec()
    assert "\n" not in str(err.value)
