"""MoE checkpoints change layout online (gloo, fp32, Adam): a tag saved at expert-parallel size 4
(world 4) loads at ep 2 (world 4, two expert-data ranks per expert), and one saved at world 2
(ep 2) loads at world 4 (ep 2). After the load every global expert's fp32 weights and Adam
moments equal those saved, bit for bit, whichever rank holds them now; the next steps are within
1e-6 of a run that trained at the new layout from the start (not bit for bit: that run summed its
expert gradients over another set of ranks, so its weights at the save step already differ by ulps).
"""

from __future__ import annotations

import pytest

from tests.distributed import run_world
from tests.runtime.moe.models import MoECase, TinyMoENet, batch

BEFORE, AFTER, GLOBAL_BATCH = 2, 3, 64
CASE = MoECase(1, False, False)  # no token dropping: the same tokens reach each expert at any layout


def _engine(rank: int, world: int, ep_size: int, stage: int, extra: dict | None = None):  # noqa: ANN202
    import dslaunch as deepspeed
    from dslaunch.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = TinyMoENet(CASE, ep_size)
    model.set_expert_weights((rank % ep_size) * model.moe.num_local_experts)
    params = split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "name": "p"})
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": 16,
              "steps_per_print": 1000, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": stage}, **(extra or {})}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    return engine, model


def _steps(engine, rank: int, world: int, first: int, count: int) -> list[float]:  # noqa: ANN001
    """``count`` steps from ``first``, each of the 4 micro batches of 16 samples the world 4 runs at
    once (at world 2: two accumulated micro steps; not one of 32 samples, whose load-balancing
    loss, a product of two means over the batch, would be another function)."""
    losses = []
    for step in range(first, first + count):
        micro = []
        for j in range(4 // world):
            loss = engine(*batch(j * world + rank, step))
            engine.backward(loss)
            engine.step()
            micro.append(loss.item())
        losses.append(sum(micro) / len(micro))
    return losses


def _full_state(model) -> dict[str, list]:  # noqa: ANN001
    """Global parameter name -> [fp32 master, exp_avg, exp_avg_sq] as numpy arrays (a tensor would
    travel back through shared memory the rank's exit frees), gathered (collective)."""
    from dslaunch.runtime.checkpoint.experts import expert_names
    from dslaunch.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    rename = expert_names(model)
    return {rename.get(n, n): [t.numpy().copy() for t in (safe_get_full_fp32_param(p),
                                                           safe_get_full_optimizer_state(p, "exp_avg"),
                                                           safe_get_full_optimizer_state(p, "exp_avg_sq"))]
            for n, p in model.named_parameters()}


def _save(rank: int, world: int, ep_size: int, stage: int, save_dir: str, extra: dict | None = None) -> dict:
    from dslaunch.utils import groups

    engine, model = _engine(rank, world, ep_size, stage, extra)
    _steps(engine, rank, world, 0, BEFORE)
    engine.save_checkpoint(save_dir, tag="saved")
    state = _full_state(model)
    groups.grid = None
    if rank == 0:  # zero-to-fp32: every global expert under its own number
        from dslaunch.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state["export"] = {k: v.numpy().copy() for k, v in
                           get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="saved").items()}
    return state


def _resume(rank: int, world: int, ep_size: int, stage: int, load_dir: str, extra: dict | None = None) -> dict:
    """A run at the new layout that never stopped, then one resumed there from ``load_dir``
    (each with its state at the save and after ``AFTER`` more steps)."""
    from dslaunch.utils import groups

    engine, model = _engine(rank, world, ep_size, stage, extra)
    _steps(engine, rank, world, 0, BEFORE)
    unbroken_at_save = _full_state(model)
    unbroken = _steps(engine, rank, world, BEFORE, AFTER)
    unbroken_end = _full_state(model)
    engine, model = _engine(rank, world, ep_size, stage, extra)
    engine.load_checkpoint(load_dir, tag="saved")
    loaded = _full_state(model)
    resumed = _steps(engine, rank, world, BEFORE, AFTER)
    groups.grid = None
    return {"unbroken_at_save": unbroken_at_save, "unbroken": unbroken, "loaded": loaded, "resumed": resumed,
            "unbroken_end": unbroken_end, "resumed_end": _full_state(model)}


def _merged(states: list[dict]) -> dict:
    """Every rank's gathered state in one map; ranks holding one global parameter agree exactly."""
    out: dict = {}
    for state in states:
        for name, tensors in state.items():
            if name in out:
                assert all((a == b).all() for a, b in zip(out[name], tensors, strict=True)), name
            out[name] = tensors
    return out


def _worst(a: dict, b: dict) -> float:
    return max(float(abs(x - y).max()) for n in a for x, y in zip(a[n], b[n], strict=True))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("saved", "now", "stage"), [((4, 4), (4, 2), 2), ((2, 2), (4, 2), 3)],
                         ids=["ep4-to-ep2-zero2", "world2-to-world4-zero3"])
def test_moe_tag_loads_at_another_expert_layout(tmp_path, saved, now, stage) -> None:  # noqa: ANN001
    states = run_world(_save, saved[0], saved[1], stage, str(tmp_path), timeout=150)
    export = states[0].pop("export")
    before = _merged(states)
    assert sorted(export) == sorted(before) and all((export[n] == before[n][0]).all() for n in before)
    after = run_world(_resume, now[0], now[1], stage, str(tmp_path), timeout=200)
    assert {n.split("deepspeed_experts.")[1][0] for n in before if "deepspeed_experts." in n} == {"0", "1", "2", "3"}
    loaded = _merged([r["loaded"] for r in after])
    assert sorted(loaded) == sorted(before)
    for name, tensors in before.items():  # the resharding itself is exact
        for kind, a, b in zip(("fp32", "exp_avg", "exp_avg_sq"), tensors, loaded[name], strict=True):
            assert (a == b).all(), f"{name} {kind}: differs by {float(abs(a - b).max()):.2e} after the load"
    drift = _worst(before, _merged([r["unbroken_at_save"] for r in after]))
    worst = max(abs(a - b) for r in after for a, b in zip(r["unbroken"], r["resumed"], strict=True))
    print(f"saved at world/ep {saved}, loaded at {now}, ZeRO-{stage}: state at the save vs the unbroken "
          f"run {drift:.2e}; next {AFTER} losses within {worst:.2e}")
    assert worst <= 1e-6, f"the resumed losses differ from the unbroken run's by {worst:.2e}"
    assert after[0]["resumed"][0] != after[0]["resumed"][-1]  # it trains


INVARIANT = {"layout_invariant": {"enabled": True}, "gradient_clipping": 0.05}


def _unequal(a: dict, b: dict) -> list[str]:
    kinds = ("fp32", "exp_avg", "exp_avg_sq")
    return [f"{n} {k}: {float(abs(x - y).max()):.2e}" for n in a
            for k, x, y in zip(kinds, a[n], b[n], strict=True) if not (x == y).all()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("saved", "now"), [((4, 4), (4, 2)), ((2, 2), (4, 2))], ids=["ep4-to-ep2", "world2-to-world4"])
def test_layout_invariant_resume_is_bit_for_bit(tmp_path, saved, now) -> None:  # noqa: ANN001
    """Under ``layout_invariant`` (ZeRO-2, clipping on) the run saved at one layout is, at the save,
    the very state a run at the new layout reaches, and resumed there it continues bit for bit."""
    states = run_world(_save, saved[0], saved[1], 2, str(tmp_path), INVARIANT, timeout=150)
    states[0].pop("export")
    before = _merged(states)
    after = run_world(_resume, now[0], now[1], 2, str(tmp_path), INVARIANT, timeout=200)
    assert not _unequal(before, _merged([r["unbroken_at_save"] for r in after]))
    assert not _unequal(_merged([r["unbroken_end"] for r in after]), _merged([r["resumed_end"] for r in after]))
    assert [r["unbroken"] for r in after] == [r["resumed"] for r in after]
    assert after[0]["resumed"][0] != after[0]["resumed"][-1]  # it trains


def test_a_malformed_experts_record_is_named() -> None:
    from dslaunch.errors import CheckpointError
    from dslaunch.runtime.checkpoint.reshard import check_meta

    meta = {"world_size": 2, "zero_stage": 1,
            "partition": {"stage": 1, "groups": [{"names": ["w"], "shapes": [[2]], "numel": 2, "ranges": {"0": [0, 2]}}]}}
    check_meta({**meta, "experts": {"0": {"0": ["w"]}}}, "m.json")
    for bad, why in (([], "is not a map of ranks"), ({"x": {}}, "rank 'x' is malformed"),
                     ({"0": {"0": "w"}}, "rank '0' is malformed")):
        with pytest.raises(CheckpointError, match=f"meta 'experts' {why}"):
            check_meta({**meta, "experts": bad}, "m.json")
