"""``MoE`` beside tensor parallelism (a Megatron-style mpu, tensor 2 x data 2 on gloo, world 4).

The expert groups are DeepSpeed's for both settings of ``enable_expert_tensor_parallelism``
(experts over every rank, or over each tensor lane's data ranks), and training through
``deepspeed.initialize`` (ZeRO 0, 2 and 3, gradient clipping acting) gives on every rank the losses
of a two-rank data-parallel run holding every expert: the tensor slices, which see the same
tokens, split the slots and gather them back without changing a number beyond 1e-6. Also
``deepspeed.moe.mappings`` over the mpu's tensor group, and the one-line refusals: tensor-sliced
experts in groups made for whole ones, AutoEP beside tensor slices (DeepSpeed's folding).
"""

from __future__ import annotations

import pytest

from tests.distributed import run_world
from tests.runtime.moe.models import MoECase, TinyMoENet, clipped_losses

WORLD, TENSOR, STEPS = 4, 2, 8
CASES = [MoECase(1, False, True), MoECase(2, True, False)]


class MegatronMPU:
    """A Megatron-style mpu without dslaunch's named axes: tensor slices neighbours, data ranks
    every ``tp``-th (DeepSpeed's test_moe_tp layout), built by the script itself."""

    def __init__(self, tp: int) -> None:
        import torch.distributed as dist

        self.rank, world, self.tp = dist.get_rank(), dist.get_world_size(), tp
        for first in range(0, world, tp):
            ranks = list(range(first, first + tp))
            group = dist.new_group(ranks)
            self.tp_group = group if self.rank in ranks else getattr(self, "tp_group", None)
        for lane in range(tp):
            ranks = list(range(lane, world, tp))
            group = dist.new_group(ranks)
            self.dp_group = group if self.rank in ranks else getattr(self, "dp_group", None)
        self.world = world

    def get_model_parallel_rank(self) -> int:
        return self.rank % self.tp

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.rank // self.tp

    def get_data_parallel_world_size(self) -> int:
        return self.world // self.tp

    def get_data_parallel_group(self):
        return self.dp_group


def _expert_rank(rank: int, ep_size: int, sliced: bool) -> int:
    """This rank's index in its expert group under DeepSpeed's layouts (E + D)."""
    return (rank // TENSOR) % ep_size if sliced else rank % ep_size


def _groups(rank: int, world: int) -> dict:
    import dslaunch as deepspeed
    from dslaunch.moe.layer import MoE
    from dslaunch.utils import groups

    deepspeed.init_distributed(verbose=False)
    groups.mpu = MegatronMPU(TENSOR)
    out = {}
    for ep_size, sliced in ((2, True), (1, False), (2, False), (1, True)):  # a size keeps its first layout
        layer = MoE(4, __import__("torch").nn.Linear(4, 4), num_experts=4, ep_size=ep_size,
                    enable_expert_tensor_parallelism=sliced)
        layer.set_deepspeed_parallelism()
        name = layer.expert_group_name
        out[(ep_size, sliced)] = (groups._get_expert_parallel_group_ranks(name),
                                  groups._get_expert_data_parallel_group_ranks(name),
                                  groups._get_expert_model_parallel_world_size(),
                                  layer.deepspeed_moe.tensor_slices.experts_sliced)
    from dslaunch.errors import UsageError
    from dslaunch.runtime.tensor_parallel.layers import ColumnParallelLinear

    torch = __import__("torch")
    sliced_expert = ColumnParallelLinear(torch.zeros(2, 4), None, False, torch.float32, trainable=True)
    try:  # tensor-sliced experts in groups made for whole ones: one line, not wrong numbers
        MoE(4, sliced_expert, num_experts=4, ep_size=1).set_deepspeed_parallelism()  # ep 1: whole experts
        out["refused"] = ""
    except UsageError as err:
        out["refused"] = str(err)
    from dslaunch.errors import ConfigError
    from dslaunch.runtime.config.expert_parallel import ExpertParallelConfig
    from dslaunch.runtime.moe.autoep import convert_for_expert_parallel
    from tests.runtime.moe.test_autoep import CUSTOM, Net

    try:  # AutoEP folded beside tensor slices needs ep 2's groups in the folded layout, not the sliced one
        convert_for_expert_parallel(Net(), ExpertParallelConfig(**{**CUSTOM, "autoep_size": 2}))
        out["autoep"] = ""
    except ConfigError as err:
        out["autoep"] = str(err)
    from dslaunch.moe.mappings import drop_tokens, gather_tokens

    whole = torch.arange(12.0).reshape(2, 6).requires_grad_()  # the same on the tensor peers
    share = drop_tokens(whole, dim=1)
    (gather_tokens(share * (rank + 1), dim=1).sum() + share.sum()).backward()
    out["mappings"] = (share.tolist(), whole.grad.tolist())
    groups.mpu = groups.grid = None
    return out


@pytest.mark.timeout(120)
def test_expert_groups_follow_deepspeeds_layouts_beside_tensor_slices() -> None:
    got = run_world(_groups, WORLD, timeout=110)
    for rank, mine in enumerate(got):
        # ep 2 first made tensor-sliced: each lane's data ranks (0, 2 | 1, 3)
        assert mine[(2, True)] == ([rank % 2, rank % 2 + 2], [rank], TENSOR, True)
        # ep 1: every rank its own expert group, all ranks one expert-data group; sliced once any is
        assert mine[(1, False)] == ([rank], [0, 1, 2, 3], TENSOR, False)
        # a size keeps its first layout, as DeepSpeed creates a name once
        assert mine[(2, False)] == mine[(2, True)]
        assert mine[(1, True)] == mine[(1, False)]
        assert "enable_expert_tensor_parallelism=True" in mine["refused"] and "\n" not in mine["refused"]
        assert "needs [" in mine["autoep"] and "tensor-sliced" in mine["autoep"] and "\n" not in mine["autoep"]
        # deepspeed.moe.mappings over the mpu's tensor group: this slice's half of dim 1. Backward:
        # gather keeps this slice's share of the gradient (rank + 1, plus 1 through the share),
        # drop gathers the shares, so column c of the input gets the gradient of the peer whose share holds it
        lane, first = rank % TENSOR, rank - rank % TENSOR
        assert mine["mappings"][0] == [[float(6 * r + 3 * lane + c) for c in range(3)] for r in range(2)]
        assert mine["mappings"][1] == [[float(first + 2)] * 3 + [float(first + 3)] * 3] * 2


def test_expert_parallel_ranks_of_tensor_sliced_experts_are_deepspeeds() -> None:
    from dslaunch.utils.groups import _get_expert_parallel_ranks

    ep, edp = _get_expert_parallel_ranks(world_size=16, tensor_parallel_size_=2, expert_parallel_size_=4)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]


def _train(rank: int, world: int, ep_size: int, sliced: bool | None, stage: int) -> list[list[float]]:
    """``sliced`` None: no mpu (the reference, data parallel); else the tensor 2 x data 2 mpu."""
    import dslaunch as deepspeed
    from dslaunch.utils import groups

    deepspeed.init_distributed(verbose=False)
    mpu = None if sliced is None else MegatronMPU(TENSOR)
    runs = []
    for case in CASES:
        model = TinyMoENet(case, ep_size)
        model.moe.enable_expert_tensor_parallelism = bool(sliced)
        model.set_expert_weights(_expert_rank(rank, ep_size, bool(sliced)) * model.moe.num_local_experts)
        runs.append(clipped_losses(model, stage, rank if mpu is None else rank // TENSOR, STEPS, mpu))
    groups.mpu = groups.grid = None
    return runs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_training_beside_tensor_slices_gives_the_data_parallel_losses(stage: int) -> None:
    want = run_world(_train, 2, 1, None, stage, timeout=60)
    for ep_size, sliced in ((2, False), (2, True), (1, True)):
        got = run_world(_train, WORLD, ep_size, sliced, stage, timeout=90)
        for rank in range(WORLD):
            for case, ref, mine in zip(CASES, want[rank // TENSOR], got[rank], strict=True):
                worst = max(abs(a - b) for a, b in zip(ref, mine, strict=True))
                assert worst <= 1e-6, (f"ep {ep_size} sliced {sliced} rank {rank} {case.label}: losses differ by "
                                       f"{worst:.2e}: {ref} vs {mine}")
    assert want[0][0][0] != want[0][0][-1]  # it trains
