"""Expert parameters under every ZeRO stage: averaged over their expert-data group, sharded there,
counted once in the clip norm; checked against one process that holds every expert.

The model: a dense layer, one expert per rank (rank r holds expert ``r % EP``, marked as DeepSpeed's
MoE layer marks them: ``allreduce = False``, ``group_name = "ep_size_2"``) and a dense head. Tokens
are routed by rank (rank r's go to its own expert), so no all-to-all is needed: the reference sends
each rank's batch through that rank's expert and averages the ranks' losses. Clipping is active
(the first global norm is 8x the clip), so a norm that counted an expert twice, or missed one, moves
the weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world

WORLD, EP, STEPS, MICRO, LR, WD, CLIP = 4, 2, 10, 2, 1e-2, 0.01, 0.02


class _Reference(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(4, 8)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(EP))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.head(torch.relu(self.experts[expert](torch.relu(self.dense(x))))).square().mean()


class _RankModel(torch.nn.Module):
    """What rank ``rank`` holds: the dense parts and its own expert."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        ref = _Reference()
        self.dense, self.expert, self.head = ref.dense, ref.experts[rank % EP], ref.head
        for p in self.expert.parameters():
            p.allreduce, p.group_name = False, f"ep_size_{EP}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.expert(torch.relu(self.dense(x))))).square().mean()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(MICRO, 4, generator=torch.Generator().manual_seed(1000 * step + rank))


def _reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    model = _Reference()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step in range(STEPS):
        loss = sum(model(_batch(step, r), r % EP) for r in range(WORLD)) / WORLD
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _train(rank: int, world: int, zero: dict) -> dict:
    import dslaunch
    from dslaunch.utils import safe_get_full_fp32_param

    dslaunch.init_distributed(verbose=False)
    model = _RankModel(rank)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP, "steps_per_print": 1000,
              "zero_optimization": zero}
    client = None
    if zero.pop("client", False):  # one group of dense and expert parameters: split in two, same object
        client = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}
    engine, *_ = dslaunch.initialize(model=model, config=config, optimizer=client)
    assert client is None or engine.basic_optimizer is client  # inside engine.optimizer, DeepSpeed's wrapper
    norms = []
    for step in range(STEPS):
        engine.backward(engine(_batch(step, rank)))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    weights = {n: safe_get_full_fp32_param(p).tolist() for n, p in model.named_parameters()}
    return {"weights": weights, "norms": norms, "groups": [g.get("name") for g in engine.optimizer.param_groups]}


ZERO = {"stage0": {"stage": 0}, "stage1": {"stage": 1},
        "stage2": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 50, "allgather_bucket_size": 40},
        "stage3": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 50},
        "stage2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "stage1_client_optimizer": {"stage": 1, "client": True}}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("zero", list(ZERO))
def test_experts_train_as_one_process_holding_every_expert(zero: str) -> None:
    want, want_norms = _reference()
    assert want_norms[0] > 5 * CLIP  # clipping is active
    for rank, got in enumerate(run_world(_train, WORLD, ZERO[zero], timeout=140)):
        assert got["groups"] == [None, f"ep_size_{EP}"]
        for name, value in got["weights"].items():
            ref = want[name.replace("expert.", f"experts.{rank % EP}.")]
            assert (torch.tensor(value) - ref).abs().max().item() < 1e-6, (zero, rank, name)
        assert got["norms"] == pytest.approx(want_norms, rel=1e-5)


def _engine(rank: int, zero: dict):
    import dslaunch

    model = _RankModel(rank)
    engine, *_ = dslaunch.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}, "zero_optimization": zero})
    return engine, model


def _steps(engine, rank: int, steps: range) -> None:
    for step in steps:
        engine.backward(engine(_batch(step, rank)))
        engine.step()


def _save_resume(rank: int, world: int, zero: dict, where: str) -> dict:
    import dslaunch
    from dslaunch.errors import CheckpointError
    from dslaunch.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from dslaunch.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    def state(model) -> list:
        return [(safe_get_full_fp32_param(p).tolist(), safe_get_full_optimizer_state(p, "exp_avg_sq").tolist())
                for p in model.parameters()]

    dslaunch.init_distributed(verbose=False)
    engine, model = _engine(rank, dict(zero))
    _steps(engine, rank, range(3))
    engine.save_checkpoint(where, tag="t")
    _steps(engine, rank, range(3, 6))
    straight = state(model)
    engine, model = _engine(rank, dict(zero))
    engine.load_checkpoint(where, tag="t")
    _steps(engine, rank, range(3, 6))
    out = {"same": state(model) == straight, "export": None}
    if rank == 0:
        try:
            get_fp32_state_dict_from_zero_checkpoint(where, tag="t")
        except CheckpointError as err:
            out["export"] = str(err)
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("zero", ["stage0", "stage2", "stage3"])
def test_a_checkpoint_of_experts_resumes_bit_for_bit_at_the_same_layout(zero: str, tmp_path) -> None:
    got = run_world(_save_resume, WORLD, ZERO[zero], str(tmp_path), timeout=140)
    assert all(r["same"] for r in got)
    assert ": the checkpoint holds expert parameters (ep_size_2), whose values differ" in got[0]["export"]
