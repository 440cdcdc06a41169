"""Engine behaviour end to end: fp16 loss scaling, memory per stage, the DeepSpeed API surface."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math

import pytest
import torch

from dslaunch.errors import ConfigError, UsageError
from tests.distributed import run_world
from tests.runtime.models import batches, make_model


def _cfg(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200},
            **extra}


def _fp16_run(rank: int, world: int, stage: int, static: bool) -> list[tuple]:
    import dslaunch

    fp16 = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1}
    if static:
        fp16 = {"enabled": True, "loss_scale": 128}
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                            "warmup_num_steps": 10}}
    engine, _, _, _ = dslaunch.initialize(model=make_model(), config=_cfg(stage, fp16=fp16,
                                                                          scheduler=sched))
    seen = []
    for step, (tokens, labels) in enumerate(batches(5, 2 * world)):
        loss = engine(tokens[rank * 2:rank * 2 + 2], labels[rank * 2:rank * 2 + 2])
        if step == 1 and rank == world - 1:
            loss = loss * 1e30  # this rank's fp16 gradients overflow; every rank must skip
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(loss)
        engine.step()
        engine.zero.synchronize()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters(), strict=True))
        seen.append((engine.loss_scale(), engine.was_step_applied(), unchanged, engine.get_lr()[0],
                     engine.skipped_steps))
    return seen


def _fp16_runs(rank: int, world: int) -> list[list[tuple]]:
    return [_fp16_run(rank, world, stage, static) for stage, static in ((0, False), (2, False), (1, True))]


@pytest.mark.timeout(90)
def test_fp16_overflow_skips_step_and_follows_scale_rules() -> None:
    """Dynamic scaling at stages 0 and 2, static scaling at stage 1; overflow on one rank only."""
    for dynamic0, dynamic2, static in run_world(_fp16_runs, 2):
        for seen in (dynamic0, dynamic2):
            scales = [s[0] for s in seen]
            # DeepSpeed 0.19's rules (hysteresis 1, window 2): halve on overflow; double when the
            # clean iterations since the last overflow, not counting the current one, reach 2.
            assert scales == [16.0, 8.0, 8.0, 8.0, 16.0]
            assert [s[1] for s in seen] == [True, False, True, True, True]
            assert [s[2] for s in seen] == [False, True, False, False, False]  # frozen on the skip
            lrs = [s[3] for s in seen]
            assert lrs[1] == lrs[0] and lrs[2] > lrs[1]  # the scheduler does not advance on a skip
            assert seen[-1][4] == 1
        assert [s[0] for s in static] == [128.0] * 5
        assert [s[1] for s in static] == [True, False, True, True, True]


# name -> (config extras, zero_optimization extras). reduce_bucket_size 1000 is below the model's
# 2804 elements (and above its largest parameter, 768); the default (5e8) is far above it.
_MEMORY_CASES = {
    "fp32": ({}, {"reduce_bucket_size": 1000, "allgather_bucket_size": 1000, "overlap_comm": True}),
    "fp32-default-buckets": ({}, {}),
    "bf16": ({"bf16": {"enabled": True}}, {"reduce_bucket_size": 1000, "overlap_comm": True}),
    "fp32-bf16-comm": ({"communication_data_type": "bf16"}, {"reduce_bucket_size": 1000}),
}


_STATE = ("optimizer_state", "master", "gradients")


def _sum(held: dict, keys: tuple[str, ...]) -> int:
    return sum(held[k] for k in keys)


def _held_all(rank: int, world: int) -> dict[str, list[dict]]:
    return {name: [_held(rank, world, stage, *case) for stage in (0, 1, 2)]
            for name, case in _MEMORY_CASES.items()}


def _held(rank: int, world: int, stage: int, extra: dict, zero: dict) -> dict:
    import dslaunch

    engine, _, _, _ = dslaunch.initialize(model=make_model(), config={
        **_cfg(stage), "zero_optimization": {"stage": stage, **zero}, **extra})
    tokens, labels = batches(1, 2 * world)[0]
    for _ in range(2):
        engine.backward(engine(tokens[rank * 2:rank * 2 + 2], labels[rank * 2:rank * 2 + 2]))
        grads_on_params = sum(p.grad is not None for p in engine.module.parameters())
        engine.step()
    params = list(engine.module.parameters())
    return {**engine.zero.held_bytes(), "grads_on_params": grads_on_params,
            "numel": sum(p.numel() for p in params), "largest": max(p.numel() for p in params),
            "elem": params[0].element_size()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_partitioned_state_is_one_nth_of_stage0(world: int) -> None:
    """Optimizer state, fp32 masters and (stage 2) gradients per rank are 1/N of stage 0's (up to
    the padding of the last shard); communication buffers are bounded by the bucket size."""
    from dslaunch.runtime.zero.reducer import MAX_INFLIGHT_BUFFERS

    by_rank = run_world(_held_all, world)
    for name, (extra, zero) in _MEMORY_CASES.items():
        full = by_rank[0][name][0]
        n, elem = full["numel"], full["elem"]
        slot = math.ceil(n / world)  # the largest rank's share of a group (n elements)
        is16 = elem == 2
        comm_elem = 2 if is16 or extra.get("communication_data_type") == "bf16" else 4
        bucket = min(max(zero.get("reduce_bucket_size", 500_000_000), full["largest"]), n)
        assert full["optimizer_state"] == 8 * n, name  # exp_avg + exp_avg_sq, fp32
        assert full["master"] == 4 * n * is16 and full["gradients"] == elem * n + 4 * n * is16, name

        for stage in (1, 2):
            held = [r[name][stage] for r in by_rank]
            for key in ("optimizer_state", "master"):
                assert sum(h[key] for h in held) == full[key], (name, stage, key)
            sharded = _STATE if stage == 2 else _STATE[:2]  # ZeRO-1 keeps the full gradient
            assert max(_sum(h, sharded) for h in held) * n <= _sum(full, sharded) * slot, (name, stage)
            if stage == 2:
                assert sum(h["gradients"] for h in held) == 4 * n, name  # fp32 gradient shards
                assert all(h["grads_on_params"] == 0 for h in held)  # no full gradients kept
            else:  # only the fp32 copy of a 16-bit gradient is a shard
                assert sum(h["gradients"] - elem * n for h in held) == 4 * n * is16, name
            # everything counted, comm buffers included: below stage 0 even for a small model
            assert max(_sum(h, _STATE + ("comm_buffers",)) for h in held) < \
                _sum(full, _STATE + ("comm_buffers",)), (name, stage)
        # Communication buffers: stage 0/1 reduce and gather in place (a copy only to change the
        # dtype, at most MAX_INFLIGHT_BUFFERS + 1 at once); stage 2 holds bucket buffers: the
        # reductions in flight plus the buckets backward is still filling (3 in this model).
        for stage in (0, 1, 2):
            comm = [r[name][stage]["comm_buffers"] for r in by_rank]
            if stage < 2 and comm_elem == elem:
                assert comm == [0] * world, (name, stage)
            elif bucket == n:  # one bucket: one buffer of the whole model, in the comm dtype
                assert comm == [n * comm_elem] * world, (name, stage)
            else:
                assert 0 < max(comm) <= (MAX_INFLIGHT_BUFFERS + 1) * bucket * comm_elem, (name, stage, comm)


def _api(rank: int, world: int, path: str) -> dict:
    import dslaunch

    parser = dslaunch.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
    tokens, labels = batches(1, 16)[0]
    data = list(zip(tokens, labels, strict=True))
    engine, optimizer, loader, sched = dslaunch.initialize(args=args, model=make_model(),
                                                           training_data=data)
    out = {"len": len(loader), "sched": sched, "opt_is_engine_opt": optimizer is engine.optimizer,
           "triad": (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                     engine.gradient_accumulation_steps()),
           "stage": engine.zero_optimization_stage(), "fp16": engine.fp16_enabled(),
           "bf16": engine.bfloat16_enabled(), "rank": (engine.global_rank, engine.local_rank),
           "device": str(engine.device)}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for batch_tokens, batch_labels in loader:
            engine.backward(engine(batch_tokens, batch_labels))
            out.setdefault("boundaries", []).append(engine.is_gradient_accumulation_boundary())
            engine.step()
    out["printed"] = printed.getvalue()
    out["norm"] = engine.get_global_grad_norm()
    state = engine.engine_state_dict()
    out["state"] = {k: state[k] for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")}
    engine.load_engine_state_dict({**state, "global_steps": 7})
    out["restored"] = engine.global_steps
    try:
        with engine.no_sync():
            pass
        out["no_sync"] = "ok"
    except UsageError as err:
        out["no_sync"] = str(err)
    try:
        dslaunch.initialize(args=args, model=make_model(), config={"train_batch_size": 4})
    except ConfigError as err:
        out["twice"] = str(err)
    return out


@pytest.mark.timeout(60)
def test_deepspeed_api_surface(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**_cfg(2), "gradient_accumulation_steps": 2, "wall_clock_breakdown": True, "gradient_clipping": 10.0,
                                "steps_per_print": 1}))
    out = run_world(_api, 2, str(path))
    for rank, o in enumerate(out):
        assert o["len"] == 4 and o["sched"] is None and o["opt_is_engine_opt"]
        assert o["triad"] == (8, 2, 2) and o["stage"] == 2 and not o["fp16"] and not o["bf16"]
        assert o["rank"] == (rank, rank) and o["device"] == "cpu"
        assert o["boundaries"] == [False, True, False, True]
        assert o["norm"] is not None and o["norm"] > 0
        assert o["state"] == {"global_steps": 2, "global_samples": 16, "micro_steps": 4, "skipped_steps": 0}
        assert o["restored"] == 7
        assert "no_sync context manager is incompatible with ZeRO stages 2 and 3" in o["no_sync"]
        assert "given both" in o["twice"]
    assert "[dslaunch] step=2" in out[0]["printed"] and "time (ms) | forward:" in out[0]["printed"]
    assert out[1]["printed"] == ""  # rank 0 reports


def _comm_per_micro_step(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import dslaunch

    calls = {"n": 0}
    for name in ("all_reduce", "broadcast", "reduce_scatter", "all_gather"):
        real = getattr(dist, name)

        def counted(*args, _real=real, **kwargs):
            calls["n"] += 1
            return _real(*args, **kwargs)
        setattr(dist, name, counted)  # counts the engine's collectives; they still run
    out = {}
    for stage in (0, 1, 2):
        engine, _, _, _ = dslaunch.initialize(model=make_model(), config={
            **_cfg(stage), "gradient_accumulation_steps": 4, "gradient_clipping": 1.0})
        tokens, labels = batches(1, 2 * world)[0]
        per_step = []
        for _ in range(8):
            before = calls["n"]
            engine.backward(engine(tokens[rank * 2:rank * 2 + 2], labels[rank * 2:rank * 2 + 2]))
            engine.step()
            per_step.append(calls["n"] - before)
        out[stage] = per_step
    return out


@pytest.mark.timeout(60)
def test_accumulation_communicates_only_at_boundaries() -> None:
    """Stages 0/1 are silent between boundaries; stage 2 reduces every micro step (it keeps no
    full gradient), as in DeepSpeed."""
    for out in run_world(_comm_per_micro_step, 2):
        for stage in (0, 1):
            assert [n > 0 for n in out[stage]] == [False, False, False, True] * 2, out[stage]
        assert all(n > 0 for n in out[2]), out[2]
