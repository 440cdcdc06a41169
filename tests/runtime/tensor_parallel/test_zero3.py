"""AutoTP with ZeRO stage 3 (``"tensor_parallel": {"autotp_size": 2}``, ``"zero_optimization":
{"stage": 3}``) on 4 gloo ranks, fp32: tp 2 x dp 2, each tensor slice partitioned over its 2
data-parallel ranks, every parameter gathered per module (``stage3_param_persistence_threshold``
0: none kept whole).

Stage 3 and stage 2 run the same gradient reduction and the same step; only where the weights
live differs: their losses, gradient norms and whole weights must be equal bit for bit, and the
one-process model's within rounding. A tag resumes bit for bit, loads at another degree and stage,
and its exports (``save_16bit_model``, ``zero_to_fp32``) are the whole, unsliced model.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.tensor_parallel.models import TrainableLM, rule_batch

pytestmark = pytest.mark.timeout(120)

STEPS, BATCH = 6, 8
# SGD with momentum (a state partitioned as Adam's): Adam's update is lr * sign(g) for a gradient of
# rounding noise (a key bias: softmax ignores it), which the sharded sums round otherwise than one
# process does, so its weights could not be compared with the one-process model's.
SGD = {"type": "SGD", "params": {"lr": 0.3, "momentum": 0.9}}


def _config(tp: int, stage: int, world: int, optimizer: bool = True, loss_parallel: bool = False,
            offload: bool = False) -> dict:
    host = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}} if offload else {}
    return {"train_micro_batch_size_per_gpu": BATCH * tp // world, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.5, "steps_per_print": 1000,
            **({"optimizer": SGD} if optimizer else {}),
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "stage3_gather_16bit_weights_on_model_save": True, **host},
            "tensor_parallel": {"autotp_size": tp, "loss_parallel": loss_parallel}}


def _engine(tp: int, stage: int, world: int, zero_init: bool = False, optimizer: bool = True,
            tied: bool = False, offload: bool = False):
    import dslaunch

    torch.manual_seed(0)
    if zero_init:  # built partitioned over every rank, before the engine (zero.Init's default group)
        dslaunch.init_distributed()
        with dslaunch.zero.Init():
            model = TrainableLM(tied=tied)
        # TrainableLM re-initialises its embedding after building it: under zero.Init that met the
        # partitioned placeholder; done whole here, as a script under zero.Init does it
        with dslaunch.zero.GatheredParameters([model.lm.embed.weight], modifier_rank=0):
            torch.nn.init.normal_(model.lm.embed.weight, std=0.02)
    else:
        model = TrainableLM(tied=tied)
    config = _config(tp, stage, world, optimizer, loss_parallel=tied, offload=offload)
    return dslaunch.initialize(model=model, config=config)[0]


def _ids(engine, step: int) -> torch.Tensor:
    micro = BATCH // engine.dp_world_size
    data_rank = engine.grid.get_data_parallel_rank()
    return rule_batch(step, BATCH)[data_rank * micro:(data_rank + 1) * micro]


def _steps(engine, first: int, count: int) -> list[float]:
    """Train ``count`` steps from ``first``; each step's loss, the mean over the replicas."""
    out = []
    for step in range(first, first + count):
        ids = _ids(engine, step)
        loss = engine(input_ids=ids, labels=ids)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(mean)
            mean /= torch.distributed.get_world_size()  # every slice of a replica holds its replica's loss
        out.append(mean.item())
    return out


def _whole(engine) -> dict:
    if engine.zero.stage == 3 or engine.grid.get_model_parallel_world_size() > 1:
        return engine._consolidated_16bit_state_dict()
    return {k: v.clone() for k, v in engine.module_state_dict().items()}


def _train(rank: int, world: int, tp: int, stage: int, zero_init: bool = False, tied: bool = False,
           offload: bool = False) -> dict:
    from dslaunch.utils import safe_get_full_fp32_param

    engine = _engine(tp, stage, world, zero_init, tied=tied, offload=offload)
    losses = _steps(engine, 0, STEPS)
    sliced = getattr(engine.module, "ds_tensor_layout", {})
    replicated = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if n not in sliced}
    shards = sum(g.master.numel() for g in engine.zero.groups)
    # DeepSpeed's optimizer._global_grad_norm (its TestTpGradNorm reads it): the engine's last norm
    assert engine.optimizer._global_grad_norm == engine.get_global_grad_norm() > 0
    return {"losses": losses, "norm": engine.optimizer._global_grad_norm, "whole": _whole(engine),
            "shard": shards, "replicated": replicated, "tp_rank": engine.grid.get_model_parallel_rank(),
            "data_rank": engine.grid.get_data_parallel_rank()}


@pytest.fixture(scope="module")
def alone() -> dict:
    return run_world(_train, 1, 1, 2)[0]


@pytest.fixture(scope="module")
def stage2() -> list[dict]:
    return run_world(_train, 4, 2, 2)


def test_stage_3_trains_as_stage_2_and_the_unsharded_model(alone: dict, stage2: list[dict]) -> None:
    got = run_world(_train, 4, 2, 3)
    z2, z3 = stage2[0], got[0]
    assert z3["losses"] == z2["losses"] and z3["norm"] == z2["norm"]  # the same arithmetic
    assert z3["whole"].keys() == alone["whole"].keys()
    for name, value in z3["whole"].items():  # whole, unsliced: the one-process model's names and shapes
        assert torch.equal(value, z2["whole"][name]), name
        torch.testing.assert_close(value, alone["whole"][name], rtol=0, atol=5e-7, msg=name)
    worst = max(abs(a - b) for a, b in zip(z3["losses"], alone["losses"], strict=True))
    assert worst <= 1e-6, (worst, z3["losses"], alone["losses"])
    assert alone["losses"][-1] < alone["losses"][0] - 0.05  # it trains
    # each rank's fp32 shard: half of its slice, a 1/(tp x dp) share of the whole (+ half the replicated)
    whole = sum(v.numel() for v in alone["whole"].values())
    assert all(r["shard"] <= whole / 4 * 1.15 for r in got), ([r["shard"] for r in got], whole)
    assert [r["whole"] for r in got[1:]] == [None, None, None]  # on rank 0 only (None elsewhere, as DeepSpeed)
    # the parameters whole on every slice (norms, row biases) stay equal on every rank: their
    # gradients are the same on every slice (as in DeepSpeed, nothing sums them over the slices)
    assert {r["tp_rank"] for r in got} == {0, 1} and len(got[0]["replicated"]) >= 9
    for r in got[1:]:
        for name, value in r["replicated"].items():
            assert torch.equal(value, got[0]["replicated"][name]), (r["tp_rank"], r["data_rank"], name)


@pytest.mark.parametrize("zero_init, offload", [(True, False), (False, True)])
def test_zero_init_and_offload(stage2: list[dict], zero_init: bool, offload: bool) -> None:
    """zero.Init partitions the model over all 4 ranks as it is built; initialize gathers it whole
    to cut the slices, and stage 3 partitions each slice (and the replicated rest) over its
    data-parallel ranks. ``offload_param`` and ``offload_optimizer`` keep the shards in host
    memory. Either run is the plain one, bit for bit."""
    got = run_world(_train, 4, 2, 3, zero_init, False, offload)[0]
    assert got["losses"] == stage2[0]["losses"]
    for name, value in got["whole"].items():
        assert torch.equal(value, stage2[0]["whole"][name]), name


def test_a_tied_output_layer_and_the_vocab_parallel_loss() -> None:
    """GPT-2's tie (the output layer holds the embedding's vocabulary shard: one parameter used by
    two modules, gathered for both) with ``loss_parallel``: stage 3 is stage 2, bit for bit."""
    z2, z3 = (run_world(_train, 4, 2, stage, False, True)[0] for stage in (2, 3))
    assert z3["losses"] == z2["losses"] and z3["losses"][-1] < z3["losses"][0] - 0.05
    assert torch.equal(z3["whole"]["lm.head.weight"], z3["whole"]["lm.embed.weight"])
    for name, value in z3["whole"].items():
        assert torch.equal(value, z2["whole"][name]), name


def _checkpoints(rank: int, world: int, root: str) -> dict:
    """4 steps, save (and export), 3 more; the tag loaded at tp 2 stage 3 (3 steps), tp 2 stage 2
    and tp 4 stage 3."""
    from dslaunch.runtime.zero.partition_parameters import GatheredParameters
    from dslaunch.utils import safe_get_full_fp32_param

    engine = _engine(2, 3, world)
    _steps(engine, 0, 4)
    engine.save_checkpoint(root, tag="t4")
    assert engine.save_16bit_model(root, "model16.bin") is True
    # a column slice: "full" is this rank's slice, whole over the data-parallel ranks (as DeepSpeed's)
    name = "lm.blocks.0.attn.q.weight"
    param = dict(engine.module.named_parameters())[name]
    full = safe_get_full_fp32_param(param)
    with GatheredParameters([param]):
        gathered = param.detach().clone()
    out = {"full": full, "gathered": gathered, "tp_rank": engine.grid.get_model_parallel_rank(),
           "layout": engine.module.ds_tensor_layout[name], "straight": _steps(engine, 4, 3)}
    for key, (tp, stage) in {"same": (2, 3), "stage2": (2, 2), "tp4": (4, 3)}.items():
        other = _engine(tp, stage, world)
        other.load_checkpoint(root, tag="t4")
        out[key] = _steps(other, 4, 3)
    return out


def test_a_tag_resumes_reshards_and_exports_the_whole_model(tmp_path) -> None:
    from dslaunch.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    got = run_world(_checkpoints, 4, str(tmp_path), timeout=110)
    for r in got:
        assert r["same"] == r["straight"], r  # bit for bit
        assert r["stage2"] == r["straight"], r  # another stage: the same arithmetic
        assert max(abs(a - b) for a, b in zip(r["tp4"], r["straight"], strict=True)) <= 1e-6, r
        dim, segments, size, _ = r["layout"]
        assert r["full"].shape[dim] == sum(b - a for a, b in segments) < size  # the tensor slice
        assert torch.equal(r["gathered"], r["full"])
    saved16 = torch.load(tmp_path / "model16.bin", weights_only=True)
    exported = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t4")
    assert saved16.keys() == exported.keys() == TrainableLM().state_dict().keys()
    for name, value in saved16.items():  # fp32 model: the weights are the masters
        assert torch.equal(value, exported[name]), name
    # the rows of the first tensor rank's slice are its safe_get_full_fp32_param
    dim, segments, _, _ = got[0]["layout"]
    rows = torch.cat([saved16["lm.blocks.0.attn.q.weight"].narrow(dim, a, b - a) for a, b in segments], dim)
    assert torch.equal(rows, got[0]["full"])
    model = TrainableLM()
    model.load_state_dict(saved16)
    with torch.no_grad():
        ids = rule_batch(4, BATCH)
        assert abs(model(input_ids=ids, labels=ids).item() - got[0]["straight"][0]) <= 1e-6


def _forward_only(rank: int, world: int) -> list[float]:
    """DeepSpeed's TestAutoTpZeroStage3: initialize without an optimizer; the forward of the
    partitioned slices."""
    engine = _engine(2, 3, world, optimizer=False)
    with torch.no_grad():
        return engine(input_ids=rule_batch(0, 2)).flatten().tolist()


def test_without_an_optimizer_the_slices_are_partitioned_for_forward() -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        want = torch.tensor(TrainableLM()(input_ids=rule_batch(0, 2)).flatten().tolist())
    for logits in run_world(_forward_only, 4):
        torch.testing.assert_close(torch.tensor(logits), want, rtol=0, atol=1e-6)
