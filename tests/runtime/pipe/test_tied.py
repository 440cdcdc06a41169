"""``TiedLayerSpec``: an input projection reused (through its weight) as the output projection on
another stage; the copies start equal and their gradients are summed, so training matches one
process where the two uses share one module. 2 stages x 2 replicas, ZeRO-1 on the data axis.

With clipping on, the global gradient norm counts the tie once (as the one process does), so the
clip factor and the weights are the one process's too."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.pipe import helpers

pytestmark = pytest.mark.timeout(150)

STEPS, GAS, LR, SEED = 20, 2, 0.1, 3


def _out_proj(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, module.weight).sum(1, keepdim=True)


def _specs() -> list:
    from dslaunch.pipe import LayerSpec, TiedLayerSpec

    w = helpers.WIDTH
    return [TiedLayerSpec("proj", torch.nn.Linear, w, w), LayerSpec(torch.nn.Tanh), LayerSpec(torch.nn.Linear, w, w),
            LayerSpec(torch.nn.Tanh), TiedLayerSpec("proj", torch.nn.Linear, w, w, forward_fn=_out_proj)]


def _reference(steps: int = STEPS, adam: bool = False, clip: float = 0.0) -> tuple[list[float], list, list[float]]:
    """Losses, final [tied, middle] weights and the gradient norm of every step in one process."""
    specs, mods = _specs(), []
    for idx, spec in enumerate(specs):
        torch.manual_seed(SEED + idx)
        mods.append(spec.build())
    mods[4] = mods[0]  # one module, two uses
    params = list(torch.nn.ModuleList(mods[:4]).parameters())
    opt = torch.optim.Adam(params, lr=LR) if adam else torch.optim.SGD(params, lr=LR)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        per = []
        for x, y in helpers.micro_batches(step, GAS * 2):
            h = x
            for m in mods[:4]:
                h = m(h)
            per.append(helpers.loss_fn(_out_proj(mods[0], h), y))
        loss = torch.stack(per).mean()
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(params, clip).item())
        opt.step()
        losses.append(loss.item())
    return losses, [mods[0].weight.detach().tolist(), mods[2].weight.detach().tolist()], norms


def _train(rank: int, world: int, virtual: int, steps: int = STEPS, adam: bool = False, clip: float = 0.0,
           zero: dict | None = None) -> dict:
    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    module = PipelineModule(_specs(), num_stages=2, loss_fn=helpers.loss_fn, seed_layers=True, base_seed=SEED,
                            partition_method="uniform", virtual_stages=virtual)
    schedule = "interleaved" if virtual > 1 else "1f1b"
    cfg = helpers.config(GAS, LR, zero_optimization=zero or {"stage": 1}, pipeline={"schedule": schedule},
                         gradient_clipping=clip)
    if adam:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": LR}}
    engine, *_ = dslaunch.initialize(model=module, config=cfg)
    data = helpers.replica_iter(steps, GAS, 2, engine.grid.get_data_parallel_rank())
    losses, norms = [], []
    for _ in range(steps):
        losses.append(engine.train_batch(data).item())
        norms.append(engine.get_global_grad_norm())
    # The state dict waits for the last publish (with overlap_param_gather still in flight after the step).
    weights = engine.module_state_dict()
    middle = weights.get("2.weight")
    return {"losses": losses, "norms": norms, "tied": weights["tied_modules.proj.weight"].tolist(),
            "middle": middle.tolist() if middle is not None else None,
            "tie_ranks": [comm["ranks"] for comm in module.tied_comms.values()]}


@pytest.mark.parametrize("virtual, zero", [(1, None), (2, None), (1, {"stage": 0, "overlap_comm": True}),
                                           (1, {"stage": 1, "overlap_comm": True, "overlap_param_gather": True})])
def test_tied_weights_train_as_one_module(virtual: int, zero: dict | None) -> None:
    """virtual 2: parts [proj, tanh] [linear] [tanh] [out proj], rank 0 holding the 1st and 3rd.
    overlap_comm: the data-parallel buckets reduce during the last backward, in place in the
    ``.grad`` the tie sums; the schedule's ReduceTiedGrads comes first (DeepSpeed's order) and
    must wait for them."""
    want_losses, (want_tied, want_middle), _ = _reference()
    got = run_world(_train, 4, virtual, STEPS, False, 0.0, zero, timeout=140)
    for rank, r in enumerate(got):
        assert r["tie_ranks"] == [[rank % 2, rank % 2 + 2]]  # the stages of one replica
        # relative: 4 ranks sum in another order than one process; 6 ulps by step 10 on an AMD EPYC
        assert r["losses"] == pytest.approx(want_losses, rel=4e-6, abs=0)
        torch.testing.assert_close(torch.tensor(r["tied"]), torch.tensor(want_tied), rtol=0, atol=2e-5)
    for r in got[:2] if virtual == 1 else got[2:]:  # layer 2: stage 0 (uniform: 3 + 2) or stage 1's 1st part
        torch.testing.assert_close(torch.tensor(r["middle"]), torch.tensor(want_middle), rtol=0, atol=2e-5)


def test_tied_weights_clip_as_one_module() -> None:
    """Adam, clipping at 0.05 (every step clips): each rank's global norm is the one process's, so
    the clip factor is too, and the weights stay within 1e-6 (3.6e-5 apart when the tie counted twice)."""
    steps, clip = 5, 0.05
    want_losses, (want_tied, want_middle), want_norms = _reference(steps, adam=True, clip=clip)
    assert min(want_norms) > clip  # the factor clip / (norm + 1e-6) acts at every step
    got = run_world(_train, 4, 1, steps, True, clip, timeout=140)
    for r in got:
        assert r["norms"] == pytest.approx(want_norms, rel=1e-6, abs=0)
        assert r["losses"] == pytest.approx(want_losses, rel=4e-6, abs=0)
        torch.testing.assert_close(torch.tensor(r["tied"]), torch.tensor(want_tied), rtol=0, atol=1e-6)
    for r in got[:2]:
        torch.testing.assert_close(torch.tensor(r["middle"]), torch.tensor(want_middle), rtol=0, atol=1e-6)


def _train_16bit(rank: int, world: int, accum: str | None) -> dict:
    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    module = PipelineModule(_specs(), num_stages=2, loss_fn=helpers.loss_fn, seed_layers=True, base_seed=SEED,
                            partition_method="uniform")
    cfg = helpers.config(GAS, LR, zero_optimization={"stage": 1}, bf16={"enabled": True},
                         data_types={"grad_accum_dtype": accum})
    engine, *_ = dslaunch.initialize(model=module, config=cfg)
    data = helpers.replica_iter(5, GAS, 2, engine.grid.get_data_parallel_rank())
    losses = [engine.train_batch(data).item() for _ in range(5)]
    return {"losses": losses, "tied": engine.module_state_dict()["tied_modules.proj.weight"].float()}


def test_tied_weights_with_fp32_gradient_sums_stay_one_weight() -> None:
    """bf16 with ``data_types.grad_accum_dtype: "fp32"``: the tie sums the fp32 sums (no 16-bit
    ``.grad`` is kept), so both stages' copies take the same step and stay equal; the losses
    follow one process's fp32 training to bf16's precision."""
    want_losses, _, _ = _reference(5)
    for accum in ("fp32", None):
        got = run_world(_train_16bit, 4, accum, timeout=140)
        for replica in (0, 1):
            assert torch.equal(got[replica]["tied"], got[replica + 2]["tied"]), accum  # stages 0 and 1
        assert got[0]["losses"] == pytest.approx(want_losses, rel=2e-2), accum
