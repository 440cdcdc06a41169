"""``engine.offload_states`` / ``reload_states`` on 2 gloo ranks, ZeRO stages 0-3, fp32 and bf16.

On CPU the "device" is the CPU, so what is checked is the bookkeeping: each state's storages are
emptied (0 bytes) while their holders point at host copies with the same values, reload gives the
same storages back with the same values, and training with a round trip (all states after a step;
the gradients between a backward and its step; the optimizer state and master during a forward, as
RLHF's generation does) is bitwise the same as without. The memory drop on a GPU is
``tests/gpu/test_offload_states.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed import one_rank, run_world
from tests.runtime.models import batches, make_model

STEPS, MICRO = 3, 2


def _config(stage: int, bf16: bool, shm: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            # overlap: the publish after a step is still in flight when offload_states is called
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 200,
                                  "overlap_comm": True, "overlap_param_gather": True,
                                  "stage3_param_persistence_threshold": 20},
            "bf16": {"enabled": bf16}, "shared_memory_collectives": shm}


def _snapshot(zero, states) -> list:
    """(holder, storage id, value copy) of every tensor of ``states`` with memory."""
    return [(h, h.get().untyped_storage()._cdata, h.get().clone())
            for s in states for h in zero.state_holders(s)
            if torch.is_tensor(h.get()) and h.get().untyped_storage().nbytes() > 0]


def _round_trip(engine, states, check: dict) -> None:
    """Offload ``states``, check every holder, reload, check again; count what moved in ``check``."""
    from dslaunch.runtime.zero.offload_states import get_state_devices

    zero = engine.zero
    zero.synchronize()  # values read before: no publish writing them any more
    before = _snapshot(zero, states)
    engine.offload_states(include=states, pin_memory=True)
    for h, storage, value in before:
        now = h.get()
        if now is None:  # a .grad hidden while offloaded
            continue
        emptied = now.untyped_storage()._cdata != storage
        check["moved"] += emptied
        check["kept"] += not emptied
        assert torch.equal(now, value)
        if emptied:  # the original storage went to 0 bytes: find it through the moved record
            assert any(m.storage._cdata == storage and m.storage.nbytes() == 0
                       for moves in zero._states.moved.values() for m in moves)
    for s in states:
        assert get_state_devices(engine, s) <= {torch.device("cpu")}
    engine.reload_states()
    for h, storage, value in before:
        assert h.get().untyped_storage()._cdata == storage and torch.equal(h.get(), value)
    assert not zero._states.offloaded


def _train(rank: int, world: int, stage: int, bf16: bool, shm: str, trip: bool) -> tuple[list, list, dict]:
    import dslaunch
    from dslaunch.runtime.zero.offload_config import OffloadStateTypeEnum as S
    from dslaunch.utils import safe_get_full_fp32_param

    model = make_model()
    engine, *_ = dslaunch.initialize(model=model, model_parameters=model.parameters(),
                                     config=_config(stage, bf16, shm))
    check = {"moved": 0, "kept": 0, "refused": 0}
    losses = []
    for i, (tokens, labels) in enumerate(batches(STEPS, MICRO * world)):
        lo = rank * MICRO
        loss = engine(tokens[lo:lo + MICRO], labels[lo:lo + MICRO])
        engine.backward(loss)
        if trip and i == 1:  # the reduced gradients between backward and step
            _round_trip(engine, [S.lp_grads, S.contiguous_grad_buffer], check)
        engine.step()
        losses.append(loss.item())
        if trip and i == 0:
            engine.offload_states()  # the step's publish still in flight: offload waits for it
            engine.reload_states()
            _round_trip(engine, list(S), check)
            engine.offload_states()
            for call in (functools.partial(engine, tokens[:MICRO], labels[:MICRO]), engine.step):
                try:
                    call()
                except dslaunch.errors.UsageError as e:
                    check["refused"] += "reload_states" in str(e)
            engine.reload_states()
        if trip and i == 1:  # RLHF's generation: the optimizer's states away, the weights in place
            engine.offload_states(include=[S.optim_states, S.hp_params, S.contiguous_grad_buffer])
            with torch.no_grad():
                engine(tokens[:MICRO], labels[:MICRO])
            engine.reload_states()
    weights = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
    return losses, weights, check


def _compare(rank: int, world: int, stage: int, shm: str) -> dict:
    counts = {}
    for bf16 in (False, True):
        plain = _train(rank, world, stage, bf16, shm, trip=False)
        trip = _train(rank, world, stage, bf16, shm, trip=True)
        assert plain[0] == trip[0], (bf16, plain[0], trip[0])
        assert all(torch.equal(a, b) for a, b in zip(plain[1], trip[1], strict=True))
        counts[bf16] = trip[2]
    return counts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_round_trip_trains_bitwise_the_same(stage: int) -> None:
    for counts in run_world(_compare, 2, stage, "never"):
        for check in counts.values():
            assert check["moved"] > 0 and check["refused"] == 2, check


@pytest.mark.timeout(120)
def test_shared_memory_stays_in_place() -> None:
    """Same-host ranks' shared-memory weights are host memory already: kept, training unchanged."""
    for counts in run_world(_compare, 2, 2, "on"):
        for check in counts.values():
            assert check["moved"] > 0 and check["kept"] > 0 and check["refused"] == 2, check


@pytest.mark.timeout(60)
@one_rank
def test_refusals() -> None:
    """DeepSpeed's refusals, each in one line; a backward into offloaded gradients fails in its hook."""
    import dslaunch
    from dslaunch.errors import UsageError
    from dslaunch.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    tokens, labels = batches(1, MICRO)[0]
    model = make_model()
    engine, *_ = dslaunch.initialize(model=model, model_parameters=model.parameters(),
                                     config=_config(2, False, "never"))
    with pytest.raises(UsageError, match="NVMe"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    with pytest.raises(UsageError, match="lp_param"):
        engine.offload_states(include=["lp_param"])
    engine.offload_states(device=OffloadDeviceEnum.none)  # a warning, nothing moved
    assert not engine.zero._states.offloaded
    engine.optimizer.offload_states(include=[OffloadStateTypeEnum.lp_grads])  # the wrapper's, as DeepSpeed's
    loss = engine(tokens, labels)
    with pytest.raises(UsageError, match="backward while ZeRO's lp_grads are offloaded"):
        loss.backward()
    engine.reload_states()
    offloaded_param = {**_config(3, False, "never")}
    offloaded_param["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu"}}
    other, *_ = dslaunch.initialize(model=make_model(), config=offloaded_param)
    with pytest.raises(UsageError, match="offload_param"):
        other.offload_states()
    frozen, *_ = dslaunch.initialize(model=make_model(), config={"train_micro_batch_size_per_gpu": 1})
    with pytest.raises(UsageError, match="without an optimizer"):
        frozen.reload_states()


@pytest.mark.timeout(60)
@one_rank
def test_offload_optimizer_leaves_host_states_out() -> None:
    """With offload_optimizer the master and optimizer state live in host memory already: left out
    of ``include`` (DeepSpeed's rule); the weights still move and come back."""
    import dslaunch
    from dslaunch.runtime.zero.offload_config import OffloadStateTypeEnum as S

    cfg = _config(2, True, "never")
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    model = make_model()
    engine, *_ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    tokens, labels = batches(1, MICRO)[0]
    engine.backward(engine(tokens, labels))
    engine.step()
    engine.offload_states()
    assert engine.zero._states.offloaded == {S.lp_params, S.lp_grads, S.contiguous_grad_buffer}
    engine.reload_states()
    engine.backward(engine(tokens, labels))
    engine.step()
