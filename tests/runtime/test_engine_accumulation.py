"""Who ends an accumulation window (``runtime/engine_accumulation.py``), at 2 gloo ranks.

``managed_gradient_accumulation: false`` (DeepSpeed 0.19): every ``step()`` is a boundary, and N
backwards then one ``step()`` train bit for bit as the engine's own count with
``gradient_accumulation_steps`` N, at ZeRO 0-3, fp32/bf16/fp16, offloaded, with a script's own
``loss.backward()``. ``coalesce_grad_reduction()``: the backwards inside reduce once, at its end.
Every refused combination in one line.
"""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import AccumulationBoundaryError, AccumulationModeError, NoSyncError, NotInDslaunchError
from dslaunch.runtime.config import load_config
from tests.distributed import one_rank, run_world
from tests.runtime.models import batches, make_model

MICRO, GAS = 2, 3


def _cfg(stage: int, managed: bool = True, gas: int = GAS, **extra) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 200, **extra.pop("zero", {})}
    # clipping that bites: the norm (taken at the step where no backward knew it ended the window)
    # must come out the same bits as the one the boundary backward folds
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 1000,
            "gradient_clipping": 0.05, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "managed_gradient_accumulation": managed, "zero_optimization": zero, **extra}


def _micro(rank: int, world: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of global micro batch ``i`` (different data per rank and per micro step)."""
    tokens, labels = batches(i + 1, MICRO * world)[i]
    tokens, labels = torch.roll(tokens, i, dims=1), torch.roll(labels, i)  # the pool repeats every 4
    return tokens[rank * MICRO:(rank + 1) * MICRO], labels[rank * MICRO:(rank + 1) * MICRO]


def _weights(engine) -> list[float]:
    engine.zero.synchronize()
    return torch.cat([p.detach().float().flatten() for p in engine.module.parameters()]).tolist()


def _managed(rank: int, world: int, stage: int, windows: list[int], **extra) -> list[float]:
    """The engine counts: a window of n micro steps by ``set_gradient_accumulation_boundary``
    (every window n == GAS: by its own count, where n != GAS: the loss divided by n by hand)."""
    import dslaunch

    engine, *_ = dslaunch.initialize(model=make_model(), config=_cfg(stage, **extra))
    i = 0
    for n in windows:
        for m in range(n):
            if n != GAS:
                engine.set_gradient_accumulation_boundary(m == n - 1)
            loss = engine(*_micro(rank, world, i))
            engine.backward(loss) if n == GAS else engine.backward(loss / n, scale_wrt_gas=False)
            engine.step()
            i += 1
    return _weights(engine)


def _unmanaged(rank: int, world: int, stage: int, windows: list[int], how: str = "engine", **extra) -> tuple:
    """The script owns the boundary: n backwards, one ``step()``; each step's (applied, global_steps,
    global_samples). ``how``: ``engine.backward``, a script's ``loss.backward()``, or the first
    backward of each window inside ``no_sync()``."""
    import contextlib

    import dslaunch

    engine, *_ = dslaunch.initialize(model=make_model(), config=_cfg(stage, managed=False, **extra))
    i, seen = 0, []
    for n in windows:
        for m in range(n):
            loss = engine(*_micro(rank, world, i))
            with engine.no_sync() if how == "no_sync" and m == 0 else contextlib.nullcontext():
                if how == "plain":
                    loss.backward()
                elif n == GAS:
                    engine.backward(loss)
                else:
                    engine.backward(loss / n, scale_wrt_gas=False)
            i += 1
        engine.step()
        seen.append((engine.was_step_applied(), engine.global_steps, engine.global_samples))
    return _weights(engine), seen


def _stages(rank: int, world: int, dtype: str) -> dict:
    half = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    out = {}
    for stage in (0, 1, 2, 3):
        out[stage] = (_managed(rank, world, stage, [GAS, GAS], **half),
                      _unmanaged(rank, world, stage, [GAS, GAS], **half),
                      _unmanaged(rank, world, stage, [GAS, GAS], "plain", **half))
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_unmanaged_steps_equal_the_engines_count(dtype: str) -> None:
    """N engine.backward()s (or loss.backward()s) then one step() == gradient_accumulation_steps N,
    bit for bit at stages 0-3; every step applies, global_steps +1, global_samples + N micro batches."""
    results = run_world(_stages, 2, dtype)
    for out in results:
        for stage, (managed, (unmanaged, seen), (plain, plain_seen)) in out.items():
            assert unmanaged == managed and plain == managed, f"stage {stage}"
            assert seen == plain_seen == [(True, 1, GAS * MICRO * 2), (True, 2, 2 * GAS * MICRO * 2)], f"stage {stage}"
    for stage in (0, 1, 2, 3):
        assert results[0][stage][0] == results[1][stage][0], f"stage {stage}: the ranks agree"
        assert results[0][stage][0] != _untrained(), f"stage {stage} trains"


def _untrained() -> list[float]:
    return torch.cat([p.detach().flatten() for p in make_model().parameters()]).tolist()


def _variants(rank: int, world: int) -> dict:
    out = {}
    for stage in (1, 3):  # the offloaded step (stage 3 partial offload: the prefetch path too)
        off = {"zero": {"offload_optimizer": {"device": "cpu", **({"ratio": 0.5} if stage == 3 else {})}}}
        out[f"offload {stage}"] = (_managed(rank, world, stage, [GAS, GAS], **off),
                                   _unmanaged(rank, world, stage, [GAS, GAS], **off))
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}
    out["fp16 2"] = (_managed(rank, world, 2, [GAS, GAS], **fp16), _unmanaged(rank, world, 2, [GAS, GAS], **fp16))
    for stage in (0, 1):  # a backward in no_sync(): reduced by the step, as the rest of the window
        out[f"no_sync {stage}"] = (_managed(rank, world, stage, [GAS, GAS]),
                                   _unmanaged(rank, world, stage, [GAS, GAS], "no_sync"))
    for stage in (0, 2):  # windows of another size than gradient_accumulation_steps, and unlike each other
        out[f"varying {stage}"] = (_managed(rank, world, stage, [2, 5, 1]), _unmanaged(rank, world, stage, [2, 5, 1]))
    inv = {"gas": 2, "layout_invariant": {"enabled": True}}
    out["layout_invariant"] = (_managed(rank, world, 2, [2, 2], **inv), _unmanaged(rank, world, 2, [2, 2], **inv))
    try:
        _unmanaged(rank, world, 2, [3], **inv)
        out["tree of 3"] = "no error"
    except ValueError as err:
        out["tree of 3"] = str(err)
    return out


@pytest.mark.timeout(90)
def test_unmanaged_with_offload_fp16_no_sync_any_window_and_layout_invariant() -> None:
    """The same bits with the optimizer offloaded (stages 1 and 3), fp16 loss scaling, a backward
    inside no_sync() (reduced by the step), windows of 2, 5 and 1 backwards against the engine's
    count with set_gradient_accumulation_boundary, and layout_invariant's tree (whose windows must
    be a power of two: one line at the step otherwise)."""
    for out in run_world(_variants, 2):
        for name, value in out.items():
            if name == "tree of 3":
                assert "needs a power of two" in value and "window of 3 backward() calls" in value, value
                continue
            managed, (unmanaged, seen) = value
            assert unmanaged == managed, name
            if not name.startswith("fp16"):
                assert all(applied for applied, _, _ in seen), name
        assert [s for _, s, _ in out["varying 0"][1][1]] == [1, 2, 3]
        assert [n for _, _, n in out["varying 0"][1][1]] == [2 * 4, 7 * 4, 8 * 4]  # backwards * MICRO * ranks


# ----- coalesce_grad_reduction ---------------------------------------------------------------
def _coalesce(rank: int, world: int, stage: int, coalesce: bool, counts: dict, **extra) -> list[float]:
    """Two optimizer steps of ``GAS`` micro steps at gradient_accumulation_steps 1, the boundary set
    on the last (DeepSpeed's pattern); the reductions inside the backwards counted in ``counts``."""
    import contextlib

    import dslaunch

    # no clipping: at stages 2/3 the norm's units are cut at the buckets' edges, stage 1's are not
    engine, *_ = dslaunch.initialize(model=make_model(), config=_cfg(
        stage, gas=1, shared_memory_collectives="never", gradient_clipping=0.0, **extra))
    i = 0
    for _ in range(2):
        counts["on"] = True
        with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
            for m in range(GAS):
                loss = engine(*_micro(rank, world, i))
                engine.set_gradient_accumulation_boundary(m == GAS - 1)
                (loss.backward() if m == 1 else engine.backward(loss))  # a script's own backward too
                i += 1
        counts["on"] = False
        engine.step()
    return _weights(engine)


def _count_all_reduces() -> dict:
    """From now on in this rank's process, ``all_reduce`` calls made while ``counts["on"]`` are
    counted in ``counts["n"]`` (the gradient reductions' collective, shared memory off); they still run."""
    import torch.distributed as dist

    counts = {"on": False, "n": 0}
    real = dist.all_reduce

    def counted(*args, **kwargs):
        counts["n"] += counts["on"]
        return real(*args, **kwargs)
    dist.all_reduce = counted
    return counts


def _coalesce_runs(rank: int, world: int) -> dict:
    counts = _count_all_reduces()
    out = {}
    for dtype in ("fp32", "bf16"):
        half = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
        for stage in (0, 1, 2, 3):
            runs = []
            for coalesce in (False, True):
                counts["n"] = 0
                runs.append((_coalesce(rank, world, stage, coalesce, counts, **half), counts["n"]))
            out[dtype, stage] = runs
    return out


@pytest.mark.timeout(120)
def test_coalesce_grad_reduction_reduces_once_and_trains_as_accumulation() -> None:
    """At stages 0-3, fp32 and bf16: the block's backwards all-reduce nothing until it ends, then
    once per bucket (a third of the reductions of three backwards at stages 2/3; as many as the
    boundary backward's at stages 0/1, which accumulate so anyway). The weights: bit for bit the
    accumulation's at stages 0/1, and at stages 2/3 bit for bit stage 1's (each rank's micro steps
    summed before the two ranks, as stage 1 does)."""
    results = run_world(_coalesce_runs, 2)
    for out in results:
        for (dtype, stage), ((plain, n_plain), (coalesced, n_coalesced)) in out.items():
            assert n_coalesced > 0, (dtype, stage)
            if stage < 2:
                assert coalesced == plain and n_coalesced == n_plain, (dtype, stage)
            else:
                assert n_plain == GAS * n_coalesced, (dtype, stage, n_plain, n_coalesced)
                assert coalesced == out[dtype, 1][1][0], (dtype, stage)
    assert results[0] == results[1]


def _coalesce_rules(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.utils import safe_get_full_grad

    out = {}
    engine, *_ = dslaunch.initialize(model=make_model(), config=_cfg(2, gas=1))
    param = next(engine.module.parameters())
    with engine.coalesce_grad_reduction():
        engine.backward(engine(*_micro(rank, world, 0)))
        out["local"] = safe_get_full_grad(param).clone()  # this rank's own, as DeepSpeed's param.grad
        for name, call in (("step", engine.step), ("no_sync", lambda: engine.no_sync().__enter__()),
                           ("nested", lambda: engine.coalesce_grad_reduction().__enter__())):
            try:
                call()
                out[name] = "no error"
            except NoSyncError as err:
                out[name] = (str(err), isinstance(err, AssertionError))
    out["reduced"] = safe_get_full_grad(param).clone()
    engine.step()
    out["steps"] = engine.global_steps
    with engine.coalesce_grad_reduction():  # a second block: the state was reset
        engine.backward(engine(*_micro(rank, world, 1)))
    engine.step()
    out["steps"] = (out["steps"], engine.global_steps)
    engine.set_gradient_accumulation_boundary(False)  # the block leaves the engine's boundary as it was
    with engine.coalesce_grad_reduction():
        engine.backward(engine(*_micro(rank, world, 2)))
    engine.step()
    out["not a boundary"] = (engine.global_steps, engine._is_gradient_accumulation_boundary)
    engine.set_gradient_accumulation_boundary(True)
    engine.step()  # the block's reduced gradients
    out["steps"] += (engine.global_steps,)
    try:
        with engine.coalesce_grad_reduction():
            engine.backward(engine(*_micro(rank, world, 2)))
            raise KeyError("inside")
    except KeyError:
        out["after raise"] = safe_get_full_grad(param).abs().sum().item()  # dropped, nothing reduced
    return out


@pytest.mark.timeout(60)
def test_coalesce_grad_reduction_keeps_deepspeeds_rules() -> None:
    """Inside the block safe_get_full_grad reads this rank's own sum; step(), no_sync() and a nested
    block raise (NoSyncError, an AssertionError as DeepSpeed's); blocks one after the other each
    step once (at a boundary: the block leaves the engine's boundary as it found it, as DeepSpeed's);
    a block that raises drops its gradients without a collective."""
    results = run_world(_coalesce_rules, 2)
    for out in results:
        assert "step() inside no_sync" in out["step"][0] and out["step"][1]
        assert "reentry is unsupported" in out["no_sync"][0] and out["no_sync"][1]
        assert "cannot be nested" in out["nested"][0] and out["nested"][1]
        assert out["steps"] == (1, 2, 3) and out["not a boundary"] == (2, False)
        assert out["after raise"] == 0.0
    assert not torch.equal(results[0]["local"], results[1]["local"])  # each rank's own
    assert torch.equal(results[0]["reduced"], results[1]["reduced"])
    torch.testing.assert_close(results[0]["reduced"], (results[0]["local"] + results[1]["local"]) / 2)


# ----- enable_backward_allreduce = False + allreduce_gradients() ---------------------------------
def _scheduled(rank: int, world: int, stage: int, counts: dict) -> list[float]:
    """An external micro-batch scheduler's pattern: backward reduces nothing, the script calls
    ``allreduce_gradients()`` after the window's last backward, then ``step()``."""
    import dslaunch

    engine, *_ = dslaunch.initialize(model=make_model(), config=_cfg(
        stage, gas=1, shared_memory_collectives="never", gradient_clipping=0.0))
    engine.enable_backward_allreduce = False
    i = 0
    for _ in range(2):
        counts["on"] = True
        for m in range(GAS):
            engine.set_gradient_accumulation_boundary(m == GAS - 1)
            engine.backward(engine(*_micro(rank, world, i)))
            i += 1
        counts["on"] = False
        engine.allreduce_gradients()
        engine.step()
    return _weights(engine)


def _scheduled_runs(rank: int, world: int) -> dict:
    counts = _count_all_reduces()
    out = {}
    for stage in (0, 1, 2, 3):
        scheduled = _scheduled(rank, world, stage, counts)
        out[stage] = (scheduled == _coalesce(rank, world, stage, True, {"on": False, "n": 0}), counts["n"])
        out[stage, "refused"], out[stage, "steps"] = _step_unreduced(rank, world, stage)
    return out


def _step_unreduced(rank: int, world: int, stage: int) -> tuple[str, int]:
    import dslaunch
    from dslaunch.errors import UsageError

    engine, *_ = dslaunch.initialize(model=make_model(), config=_cfg(stage, gas=1))
    engine.enable_backward_allreduce = False
    engine.backward(engine(*_micro(rank, world, 0)))
    try:
        engine.step()  # a boundary with gradients never reduced: refused, not diverged or dropped
        refused = "no error"
    except UsageError as err:
        refused = str(err)
    engine.allreduce_gradients()
    engine.step()
    engine.enable_backward_allreduce = True
    engine.backward(engine(*_micro(rank, world, 1)))
    engine.allreduce_gradients()  # after a reducing backward: nothing left to reduce
    engine.step()
    return refused, engine.global_steps


@pytest.mark.timeout(120)
def test_backward_allreduce_off_leaves_gradients_until_allreduce_gradients() -> None:
    """DeepSpeed's ``enable_backward_allreduce = False`` then ``allreduce_gradients()``: at stages
    0-3 the backwards all-reduce nothing, and the weights are the same bits as
    ``coalesce_grad_reduction()``'s (one reduction of each rank's sum); a boundary ``step()`` before
    ``allreduce_gradients()`` is refused in one line; turned back on, backward reduces again."""
    for out in run_world(_scheduled_runs, 2):
        for stage in (0, 1, 2, 3):
            assert out[stage] == (True, 0), (stage, out[stage])
            refused = out[stage, "refused"]
            assert "never reduced across ranks" in refused and "allreduce_gradients()" in refused, (stage, refused)
            assert "\n" not in refused and out[stage, "steps"] == 2, stage


@one_rank
def test_backward_allreduce_off_is_refused_under_pipeline_parallelism() -> None:
    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed()
    model = PipelineModule([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=1,
                           loss_fn=torch.nn.functional.mse_loss)
    engine, *_ = dslaunch.initialize(model=model, config=_cfg(0, gas=1))
    with pytest.raises(NotInDslaunchError, match="train_batch\\(\\) reduces"):
        engine.enable_backward_allreduce = False
    assert engine.enable_backward_allreduce is True


# ----- refused, each in one line ------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 1])
def test_unmanaged_refuses_overlap_comm_below_stage_2(stage: int) -> None:
    with pytest.raises(AccumulationModeError) as err:
        load_config(_cfg(stage, managed=False, zero={"overlap_comm": True}), 1)
    msg = str(err.value)
    assert isinstance(err.value, AssertionError) and "\n" not in msg
    assert msg.startswith("'zero_optimization.overlap_comm': true with managed_gradient_accumulation false")
    assert "overlap_comm only with ZeRO stage 2" in msg  # DeepSpeed's words, which its tests match
    for ok in (2, 3):
        assert not load_config(_cfg(ok, managed=False, zero={"overlap_comm": True}), 1).managed_gradient_accumulation


def test_managed_gradient_accumulation_is_a_switch() -> None:
    with pytest.raises(ValueError, match="'managed_gradient_accumulation': must be true or false"):
        load_config(_cfg(0, managed="no"), 1)  # type: ignore[arg-type]
    assert load_config({"train_batch_size": 8}, 2).managed_gradient_accumulation is True


@pytest.mark.timeout(60)
@one_rank
def test_unmanaged_refuses_what_needs_the_engines_count() -> None:
    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    engine, *_ = dslaunch.initialize(model=make_model(), config=_cfg(1, managed=False))
    assert engine.managed_gradient_accumulation() is False and not engine.is_gradient_accumulation_boundary()
    with pytest.raises(AccumulationBoundaryError, match=r"^set_gradient_accumulation_boundary\(\) is not supported"):
        engine.set_gradient_accumulation_boundary(True)
    with pytest.raises(AccumulationBoundaryError, match="^coalesce_grad_reduction is not supported with managed"):
        with engine.coalesce_grad_reduction():
            pass
    engine.backward(engine(*_micro(0, 1, 0)))
    with pytest.raises(NoSyncError, match="inside no_sync"), engine.no_sync():
        engine.step()  # every step is a boundary
    managed, *_ = dslaunch.initialize(model=make_model(), config=_cfg(1, layout_invariant={"enabled": True}, gas=2))
    with pytest.raises(NotInDslaunchError, match="^coalesce_grad_reduction is not supported with layout_invariant"):
        with managed.coalesce_grad_reduction():
            pass
    pipe = PipelineModule([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=1,
                          loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(AccumulationModeError, match="false is not supported with pipeline parallelism") as err:
        dslaunch.initialize(model=pipe, config=_cfg(0, managed=False))
    assert isinstance(err.value, AssertionError) and "\n" not in str(err.value)
    pipe_engine, *_ = dslaunch.initialize(model=pipe, config=_cfg(0))
    with pytest.raises(NotInDslaunchError, match="not supported under pipeline parallelism"):
        with pipe_engine.coalesce_grad_reduction():
            pass
